package mysqlstore_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// A response the server cannot take in one packet (larger than its
// max_allowed_packet, with a MaxStoredBody raised above it) can never be stored:
// it is a non-retryable 500 idempotency_response_too_large, nothing commits, and
// the retry is answered the same way rather than a retryable 503 every time.
// TestResponseOverPacketIsRefused runs testResponseOverPacketIsRefused with and without multiStatements (see bothModes).
func TestResponseOverPacketIsRefused(t *testing.T) { bothModes(t, testResponseOverPacketIsRefused) }

func testResponseOverPacketIsRefused(t *testing.T) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			db := openDB(t, 8, "")
			var max int
			if err := db.QueryRowContext(ctxFor(t), "SELECT @@max_allowed_packet").Scan(&max); err != nil {
				t.Fatal(err)
			}
			if max > 64<<20 {
				t.Skipf("max_allowed_packet is %d bytes; too large to exceed in a test", max)
			}
			s := newStore(t, db)
			orders := ordersTable(t, db)
			runs := 0
			srv := newServer(t, s, &idem.Config{Flow: flow, MaxStoredBody: 2 * max}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				if _, err := mysqlstore.Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES ('huge')"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = w.Write(make([]byte, max+1))
			}))
			key := randomName("key-")
			for attempt := range 2 {
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
				req.Header.Set("Idempotency-Key", key)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				var p idem.Problem
				_ = json.Unmarshal(body, &p)
				if resp.StatusCode != http.StatusInternalServerError || p.Code != idem.CodeResponseTooLarge || resp.Header.Get("Retry-After") != "" {
					if len(body) > 300 {
						body = body[:300]
					}
					t.Fatalf("attempt %d: answer %d %s (Retry-After %q), want 500 %s without Retry-After", attempt, resp.StatusCode, body, resp.Header.Get("Retry-After"), idem.CodeResponseTooLarge)
				}
				if !strings.Contains(p.Detail, "body is") {
					t.Errorf("detail %q does not say the body is too large", p.Detail)
				}
			}
			if n := countOrders(t, db, orders, "huge"); n != 0 {
				t.Errorf("%d orders committed, want 0: nothing of a refused outcome commits", n)
			}
		})
	}
}
