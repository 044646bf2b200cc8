package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
)

// BenchmarkOrders measures a handler that inserts one order, served in process
// (ServeHTTP) so that the database dominates: bare (its own transaction, no idem)
// against idem's first execution in both flows and against replays, at 1 and 32
// concurrent clients. Compare ns/op with benchstat; throughput ratio = inverse.
//
//	go test -run '^$' -bench BenchmarkOrders -count 6 -benchtime 2s ./pgstore/ | tee bench.txt
func BenchmarkOrders(b *testing.B) {
	db := newTestDB(b, 40)
	app := newOrderApp(b, db)
	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx, err := db.pool.Begin(ctx)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		defer tx.Rollback(context.Background())
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO `+app.orders+` (idem_key, tag) VALUES ($1, $2) RETURNING id`, r.Header.Get("Idempotency-Key"), "bare").Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if err := tx.Commit(ctx); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "{\"id\":%d,\"tag\":\"bare\"}\n", id)
	})
	order := app.handler("idem", nil)
	claim := app.serve(b, &idem.Config{Flow: idem.FlowClaimComplete}, order)
	syncApp := &orderApp{db: db, store: db.newStoreWith(b, pgstore.Config{SynchronousClaim: true}), orders: app.orders}
	claimSync := syncApp.serve(b, &idem.Config{Flow: idem.FlowClaimComplete}, order)
	single := app.serve(b, &idem.Config{Flow: idem.FlowSingleTx}, order)

	body := []byte(`{"item":"book","qty":1}`)
	run := prefixRun()
	var seq atomic.Int64
	fresh := func() string { return fmt.Sprintf("%s-%d", run, seq.Add(1)) }
	serve := func(b *testing.B, h http.Handler, key string, replay bool) {
		req := httptest.NewRequest(http.MethodPost, "/orders", bytes.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Idempotency-Key", key)
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusCreated || (rec.Header().Get(idem.ReplayedHeader) == "true") != replay {
			b.Fatalf("status %d replayed=%q: %s", rec.Code, rec.Header().Get(idem.ReplayedHeader), rec.Body)
		}
	}
	// Keys completed once, replayed by the replay benchmarks.
	replayKeys := make([]string, 256)
	for i := range replayKeys {
		replayKeys[i] = fresh()
		serve(b, claim, replayKeys[i], false)
	}

	cases := []struct {
		name   string
		h      http.Handler
		replay bool
	}{
		{"bare", bare, false},
		{"claim", claim, false},
		{"claim-sync", claimSync, false},
		{"single", single, false},
		{"replay-claim", claim, true},
		{"replay-single", single, true},
	}
	for _, tc := range cases {
		for _, clients := range []int{1, 32} {
			b.Run(fmt.Sprintf("%s/c%d", tc.name, clients), func(b *testing.B) {
				var n atomic.Int64
				key := func() string {
					if tc.replay {
						return replayKeys[int(n.Add(1))%len(replayKeys)]
					}
					return fresh()
				}
				if clients == 1 {
					for b.Loop() {
						serve(b, tc.h, key(), tc.replay)
					}
					return
				}
				b.SetParallelism((clients + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						serve(b, tc.h, key(), tc.replay)
					}
				})
			})
		}
	}
}

func prefixRun() string { return "bench-" + randomHex(4) }
