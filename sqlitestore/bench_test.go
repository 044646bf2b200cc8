package sqlitestore_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/idemkit/idem"
)

// BenchmarkOrder measures a handler that inserts one order, called in process
// (no network), at 1, 8 and 32 concurrent clients:
//
//   - bare: no idem, one autocommit INSERT (the baseline of `idem bench`);
//   - baretx: no idem, the INSERT in a transaction of its own (BEGIN, INSERT,
//     COMMIT);
//   - claim: a new key per request in the claim-then-complete flow (the claim
//     commits, then a transaction with the order and the completion);
//   - single: a new key per request in the single-transaction flow (one
//     transaction with the order and the record);
//   - replay-claim, replay-single: one key, answered from the stored record, in
//     each flow.
//
// Besides time it reports cpu-ns/op, the process's CPU time per request (robust
// to other processes on the machine), and stmts/op and begins/op, the
// statements (BEGIN, COMMIT and ROLLBACK included) and transactions the driver
// ran per request. Compare with
//
//	go test -run '^$' -bench Order -benchtime 2000x -count 6 ./sqlitestore/ > bench.txt
//	benchstat -col /mode bench.txt
func BenchmarkOrder(b *testing.B) {
	for _, clients := range []int{1, 8, 32} {
		for _, mode := range []string{"bare", "baretx", "claim", "single", "replay-claim", "replay-single"} {
			b.Run(fmt.Sprintf("mode=%s/clients=%d", mode, clients), func(b *testing.B) {
				benchOrder(b, mode, clients)
			})
		}
	}
}

func benchOrder(b *testing.B, mode string, clients int) {
	db, counts := openCountingDB(b)
	createOrders(b, db)
	store := newStore(b, db)
	var h http.Handler
	switch mode {
	case "bare":
		h = autocommitOrderHandler(db)
	case "baretx":
		h = bareOrderHandler(db)
	default:
		cfg := &idem.Config{Flow: idem.FlowClaimComplete}
		if strings.HasSuffix(mode, "single") {
			cfg.Flow = idem.FlowSingleTx
		}
		mw, err := idem.New(store, cfg)
		if err != nil {
			b.Fatal(err)
		}
		h = mw(orderHandler(nil))
	}
	replay := strings.HasPrefix(mode, "replay")
	var seq atomic.Int64
	do := func() {
		key := "replay-key"
		if !replay {
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
	if replay {
		do() // the one execution; every timed request replays it
	}
	b.ReportAllocs()
	if walPages {
		walFrames(b, db, "TRUNCATE")
	}
	start, cpu := counts.snapshot(), cpuTime()
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
	d := counts.snapshot().sub(start)
	b.ReportMetric(float64(cpuTime()-cpu)/float64(b.N), "cpu-ns/op")
	b.ReportMetric(float64(d.stmts)/float64(b.N), "stmts/op")
	b.ReportMetric(float64(d.begins)/float64(b.N), "begins/op")
	if walPages {
		b.ReportMetric(float64(walFrames(b, db, "PASSIVE"))/float64(b.N), "walpages/op")
	}
	if replay {
		if got := countOrders(b, db); got != 1 {
			b.Fatalf("%d orders after replays, want 1", got)
		}
	}
}

// cpuTime is the process's CPU time so far (user and system, the garbage
// collector's workers included): unlike wall-clock time, it does not grow when
// other processes take the machine's cores.
func cpuTime() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// autocommitOrderHandler is orderHandler without idem and without a
// transaction: one autocommit INSERT, as the bare handler of `idem bench` does.
func autocommitOrderHandler(db *sql.DB) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		var in struct{ Item string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		res, err := db.ExecContext(ctx, `INSERT INTO orders (item) VALUES (?)`, in.Item)
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		id, _ := res.LastInsertId()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"item":%q}`, id, in.Item)
	})
}

// walPages (IDEM_BENCH_WALPAGES=1) makes BenchmarkOrder report the WAL frames
// (pages) written per request, with automatic checkpoints off (which changes
// the CPU figures: use it for the page count only):
//
//	IDEM_BENCH_WALPAGES=1 go test -run '^$' -bench 'Order/mode=(bare|single)/' -benchtime 500x ./sqlitestore/
var walPages = os.Getenv("IDEM_BENCH_WALPAGES") == "1"

// walFrames runs a checkpoint of mode and returns the frames in the WAL.
func walFrames(b *testing.B, db *sql.DB, mode string) int64 {
	b.Helper()
	var busy, log, done int64
	if err := db.QueryRow("PRAGMA wal_checkpoint("+mode+")").Scan(&busy, &log, &done); err != nil {
		b.Fatal(err)
	}
	return log
}
