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

// packetSlack is more than a completion sends besides the response.
const packetSlack = 8 << 10

// A response the server cannot take in one packet (larger than its
// max_allowed_packet, with a MaxStoredBody raised above it) can never be stored:
// it is a non-retryable 500 idempotency_response_too_large, nothing commits, and
// the retry is answered the same way rather than a retryable 503 every time.
// TestResponseOverPacketIsRefused runs testResponseOverPacketIsRefused with and without multiStatements (see bothModes).
func TestResponseOverPacketIsRefused(t *testing.T) { bothModes(t, testResponseOverPacketIsRefused) }

func testResponseOverPacketIsRefused(t *testing.T) {
	for _, c := range []struct {
		flow  idem.Flow
		field string
	}{{idem.FlowClaimComplete, "body"}, {idem.FlowSingleTx, "body"}, {idem.FlowClaimComplete, "headers"}, {idem.FlowSingleTx, "headers"}} {
		flow := c.flow
		t.Run(flow.String()+"/"+c.field, func(t *testing.T) {
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
			cfg := &idem.Config{Flow: flow, MaxStoredBody: 2 * max, StoredHeaders: append([]string{"X-Big"}, idem.DefaultStoredHeaders...)}
			srv := newServer(t, s, cfg, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				if _, err := mysqlstore.Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES ('huge')"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				if c.field == "headers" {
					// Under the MEDIUMBLOB column's limit, over what the packet leaves.
					w.Header().Set("X-Big", strings.Repeat("h", max-packetSlack/2))
					w.WriteHeader(http.StatusCreated)
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
				if !strings.Contains(p.Detail, "the "+c.field+" is") || !strings.Contains(p.Detail, "max_allowed_packet") {
					t.Errorf("detail %q does not say the %s is too large", p.Detail, c.field)
				}
			}
			if n := countOrders(t, db, orders, "huge"); n != 0 {
				t.Errorf("%d orders committed, want 0: nothing of a refused outcome commits", n)
			}
		})
	}
}

// A request whose record the store cannot keep — a custom fingerprint longer
// than MaxFingerprintLength — is answered in a way that is not retryable
// (every retry would meet the same limit): 500 idempotency_response_too_large
// naming the fingerprint, without the handler's effects committed. Never 503
// store_unavailable, which clients retry forever.
func TestUnstorableClaimIsNotRetryable(t *testing.T) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 4, "")
			s := newStore(t, db)
			runs := 0
			srv := newServer(t, s, &idem.Config{Flow: flow, FingerprintFunc: func(r *http.Request, body []byte) string {
				return "acme1:" + r.URL.Path + ":" + string(body)
			}}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs++
				w.WriteHeader(http.StatusCreated)
			}))
			for _, c := range []struct {
				key, body, code, says string
				status                int
			}{
				{randomName("fp-"), strings.Repeat("b", mysqlstore.MaxFingerprintLength), idem.CodeResponseTooLarge, "fingerprint is", 500},
				{randomName("fp-"), strings.Repeat("b", mysqlstore.MaxFingerprintLength-len("acme1:/orders:")), "", "", 201},
			} {
				for attempt := range 2 {
					req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(c.body))
					req.Header.Set("Idempotency-Key", c.key)
					resp, err := http.DefaultClient.Do(req)
					if err != nil {
						t.Fatal(err)
					}
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					var p idem.Problem
					_ = json.Unmarshal(body, &p)
					if c.status == 201 {
						if resp.StatusCode != 201 {
							t.Fatalf("a fingerprint of exactly MaxFingerprintLength bytes: %d %s, want 201", resp.StatusCode, body)
						}
						continue
					}
					if resp.StatusCode != c.status || p.Code != c.code || resp.Header.Get("Retry-After") != "" || !strings.Contains(p.Detail, c.says) {
						t.Fatalf("attempt %d: %d %s (Retry-After %q), want %d %s saying %q, no Retry-After", attempt, resp.StatusCode, body, resp.Header.Get("Retry-After"), c.status, c.code, c.says)
					}
				}
			}
			if flow == idem.FlowClaimComplete && runs != 1 {
				t.Errorf("the handler ran %d times, want once (the fingerprint that fits): a claim the store refuses runs nothing", runs)
			}
		})
	}
}
