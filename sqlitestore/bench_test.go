package sqlitestore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
)

// BenchmarkOrder measures a handler that inserts one order, called in process
// (no network): bare (its own transaction, no idem), idempotent first-time in
// the claim-then-complete flow (first: a new key per request; the claim commits,
// then a transaction with the order and the completion), first-time in the
// single-transaction flow (single: one transaction with the order and the
// record), and replay (one key, answered from the stored record), at 1 and 32
// concurrent clients. Compare with
//
//	go test -run '^$' -bench Order -benchtime 2000x -count 6 ./sqlitestore/ > bench.txt
//	benchstat -col /mode bench.txt
func BenchmarkOrder(b *testing.B) {
	for _, clients := range []int{1, 32} {
		for _, mode := range []string{"bare", "first", "single", "replay"} {
			b.Run(fmt.Sprintf("mode=%s/clients=%d", mode, clients), func(b *testing.B) {
				benchOrder(b, mode, clients)
			})
		}
	}
}

func benchOrder(b *testing.B, mode string, clients int) {
	db := openDB(b)
	createOrders(b, db)
	store := newStore(b, db)
	var h http.Handler
	switch mode {
	case "bare":
		h = bareOrderHandler(db)
	default:
		cfg := &idem.Config{}
		if mode == "single" {
			cfg.Flow = idem.FlowSingleTx
		}
		mw, err := idem.New(store, cfg)
		if err != nil {
			b.Fatal(err)
		}
		h = mw(orderHandler(nil))
	}
	var seq atomic.Int64
	do := func() {
		key := "replay-key"
		if mode != "replay" {
			key = fmt.Sprintf("key-%d", seq.Add(1))
		}
		// A cancellable context, as net/http gives every request: database/sql and
		// the driver watch it during each statement.
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		r := httptest.NewRequestWithContext(ctx, http.MethodPost, "/orders", strings.NewReader(`{"item":"book"}`))
		r.Header.Set("Content-Type", "application/json")
		r.Header.Set("Idempotency-Key", key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusCreated {
			b.Fatalf("%s: answer %d %s", mode, w.Code, w.Body)
		}
	}
	if mode == "replay" {
		do() // the one execution; every timed request replays it
	}
	b.ReportAllocs()
	b.ResetTimer()
	if clients == 1 {
		for b.Loop() {
			do()
		}
	} else {
		b.SetParallelism((clients + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				do()
			}
		})
	}
	b.StopTimer()
	if mode == "replay" {
		if got := countOrders(b, db); got != 1 {
			b.Fatalf("%d orders after replays, want 1", got)
		}
	}
}
