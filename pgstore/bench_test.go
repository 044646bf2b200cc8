package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// BenchmarkOrders measures a handler that inserts one order, served in process
// (ServeHTTP) so that the database dominates: bare (its own transaction, no idem)
// against idem's first execution in the default flow and in both flows, and
// against replays, at 1, 8 and 32 concurrent clients. Compare ns/op with
// benchstat; throughput ratio = inverse. cpu-ns/op is this process's CPU per
// request and db-ns/op that of the pool's PostgreSQL backends (when PostgreSQL
// runs on this machine): both are robust to other processes taking the cores.
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
	auto := app.serve(b, nil, order)

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
	// Open every connection of the pool up front, so that no measured loop pays
	// for connecting (and db-ns/op counts no backend start-up).
	warm := make([]*pgxpool.Conn, 0, 40)
	for range 40 {
		c, err := db.pool.Acquire(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		warm = append(warm, c)
	}
	for _, c := range warm {
		c.Release()
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
		{"default", auto, false},
		{"claim", claim, false},
		{"claim-sync", claimSync, false},
		{"single", single, false},
		{"replay-claim", claim, true},
		{"replay-single", single, true},
	}
	for _, tc := range cases {
		for _, clients := range []int{1, 8, 32} {
			b.Run(fmt.Sprintf("%s/c%d", tc.name, clients), func(b *testing.B) {
				defer cpuPerOp(b, db.pool)()
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

// cpuPerOp reports, per operation, the CPU time of this process (user and
// system, the garbage collector included) as cpu-ns/op and that of the pool's
// PostgreSQL backends as db-ns/op (read from /proc: only when PostgreSQL runs
// on this machine and its processes are readable). Call the returned function
// after the loop.
func cpuPerOp(b *testing.B, pool *pgxpool.Pool) func() {
	waitPoolIdle(pool)
	start, db := processCPU(), backendsCPU(pool)
	return func() {
		// A replay's ROLLBACK may still be running: it belongs to this loop.
		waitPoolIdle(pool)
		b.ReportMetric(float64(processCPU()-start)/float64(b.N), "cpu-ns/op")
		end := backendsCPU(pool)
		if db == nil || end == nil {
			return
		}
		var sum int64
		for pid, ns := range end {
			sum += ns - db[pid] // a backend started during the loop counts whole
		}
		b.ReportMetric(float64(sum)/float64(b.N), "db-ns/op")
	}
}

// waitPoolIdle waits (at most a second) until no connection of pool is in use,
// so that the backends read are those of every connection.
func waitPoolIdle(pool *pgxpool.Pool) {
	for deadline := time.Now().Add(time.Second); pool.Stat().AcquiredConns() > 0 && time.Now().Before(deadline); {
		time.Sleep(100 * time.Microsecond)
	}
}

func processCPU() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// backendsCPU returns the CPU time of the backend of each idle connection of
// the pool, by PID, or nil when one cannot be read.
func backendsCPU(pool *pgxpool.Pool) map[uint32]int64 {
	conns := pool.AcquireAllIdle(context.Background())
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	m := make(map[uint32]int64, len(conns))
	for _, c := range conns {
		pid := c.Conn().PgConn().PID()
		ns := processCPUOf(pid)
		if ns < 0 {
			return nil
		}
		m[pid] = ns
	}
	return m
}

// processCPUOf reads the CPU time of process pid from /proc/<pid>/schedstat
// (nanoseconds, exact, unlike the 10 ms ticks of /proc/<pid>/stat), or -1.
func processCPUOf(pid uint32) int64 {
	b, err := os.ReadFile("/proc/" + strconv.FormatUint(uint64(pid), 10) + "/schedstat")
	if err != nil {
		return -1
	}
	f := strings.Fields(string(b))
	if len(f) < 1 {
		return -1
	}
	ns, err := strconv.ParseInt(f[0], 10, 64)
	if err != nil {
		return -1
	}
	return ns
}
