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

// TestLargeRefIsRefused: a handler that records a 70,000-byte reference (more
// than the ref BLOB holds) in strict sql_mode and without it: the completion
// is refused before it reaches the server, nothing commits (the order is
// rolled back with it), and the client hears a non-retryable 500
// idempotency_response_too_large — not a retryable 503 that would run the
// handler on every retry, and never a cut-short reference.
func TestLargeRefIsRefused(t *testing.T) { bothModes(t, testLargeRefIsRefused) }

func testLargeRefIsRefused(t *testing.T) {
	for _, mode := range []struct{ name, dsn string }{{"strict", ""}, {"lax", sqlModeDSN("")}} {
		for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
			t.Run(mode.name+"/"+flow.String(), func(t *testing.T) {
				t.Parallel()
				db := openDB(t, 8, mode.dsn)
				s := newStore(t, db)
				orders := ordersTable(t, db)
				srv := newServer(t, s, &idem.Config{Flow: flow}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
					if _, err := mysqlstore.Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES ('big')"); err != nil {
						http.Error(w, err.Error(), 500)
						return
					}
					idem.SetRef(r.Context(), strings.Repeat("r", 70_000))
					w.WriteHeader(http.StatusCreated)
				}))
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
				req.Header.Set("Idempotency-Key", randomName("key-"))
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				var p idem.Problem
				_ = json.Unmarshal(body, &p)
				if resp.StatusCode != http.StatusInternalServerError || p.Code != idem.CodeResponseTooLarge || resp.Header.Get("Retry-After") != "" {
					t.Fatalf("answer %d %s (Retry-After %q), want 500 %s without Retry-After", resp.StatusCode, body, resp.Header.Get("Retry-After"), idem.CodeResponseTooLarge)
				}
				if !strings.Contains(p.Detail, "ref is 70000 bytes") {
					t.Errorf("detail %q does not say the ref is too large", p.Detail)
				}
				if n := countOrders(t, db, orders, "big"); n != 0 {
					t.Errorf("%d orders committed, want 0: nothing of a refused outcome commits", n)
				}
			})
		}
	}
}
