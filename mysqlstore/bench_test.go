package mysqlstore_test

import (
	"database/sql"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// BenchmarkOrder measures a handler that inserts one order, over loopback HTTP:
//
//	mode=bare    the handler runs its own READ COMMITTED transaction, no idem
//	mode=first   through idem with the default flow (the store's preferred), a new key per request
//	mode=replay  through idem, one key already complete
//	mode=single  through idem with idem.FlowSingleTx, a new key per request
//	mode=claim   through idem with idem.FlowClaimComplete, a new key per request
//
// at 1, 8 and 32 concurrent clients, with and without multiStatements=true on the
// DSN (dsn=multi, dsn=plain). Besides ns/op it reports cpu-ns/op, the process's
// CPU time per request (which other processes on the machine do not inflate; the
// database server's CPU is not in it). Compare the modes with
//
//	go test -run '^$' -bench BenchmarkOrder -benchtime 1s -count 6 ./mysqlstore/ > new.txt
//	benchstat -col /mode new.txt
func BenchmarkOrder(b *testing.B) {
	for _, dsn := range []struct{ name, extra string }{{"plain", ""}, {"multi", "&multiStatements=true"}} {
		b.Run("dsn="+dsn.name, func(b *testing.B) { benchmarkOrder(b, dsn.extra) })
	}
}

func benchmarkOrder(b *testing.B, extra string) {
	db := openDB(b, 40, "&interpolateParams=true"+extra)
	s := newStore(b, db)
	orders := ordersTable(b, db)
	insert := "INSERT INTO `" + orders + "` (item) VALUES (?)"

	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx, err := db.BeginTx(r.Context(), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		defer tx.Rollback()
		res, err := tx.ExecContext(r.Context(), insert, "bench")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if err := tx.Commit(); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		id, _ := res.LastInsertId()
		writeOrder(w, id)
	})
	viaIdem := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		res, err := mysqlstore.Conn(r.Context()).ExecContext(r.Context(), insert, "bench")
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		id, _ := res.LastInsertId()
		writeOrder(w, id)
	})
	mw, err := idem.New(s, nil)
	if err != nil {
		b.Fatal(err)
	}
	mwSingle, err := idem.New(s, &idem.Config{Flow: idem.FlowSingleTx})
	if err != nil {
		b.Fatal(err)
	}
	mwClaim, err := idem.New(s, &idem.Config{Flow: idem.FlowClaimComplete})
	if err != nil {
		b.Fatal(err)
	}
	claimSrv := httptest.NewServer(mwClaim(viaIdem))
	defer claimSrv.Close()
	singleSrv := httptest.NewServer(mwSingle(viaIdem))
	defer singleSrv.Close()
	bareSrv := httptest.NewServer(bare)
	defer bareSrv.Close()
	idemSrv := httptest.NewServer(mw(viaIdem))
	defer idemSrv.Close()
	client := &http.Client{Transport: &http.Transport{MaxIdleConns: 128, MaxIdleConnsPerHost: 128}}
	defer client.CloseIdleConnections()

	var seq atomic.Int64
	replayKey := randomName("replay-")
	post := func(b *testing.B, url, key string, want int) {
		req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"item":"bench"}`))
		req.Header.Set("Content-Type", "application/json")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := client.Do(req)
		if err != nil {
			b.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want {
			b.Fatalf("status %d, want %d", resp.StatusCode, want)
		}
	}
	post(b, idemSrv.URL, replayKey, http.StatusCreated) // the record every replay reads

	modes := []struct {
		name string
		do   func(b *testing.B)
	}{
		{"bare", func(b *testing.B) { post(b, bareSrv.URL, "", http.StatusCreated) }},
		{"first", func(b *testing.B) {
			post(b, idemSrv.URL, fmt.Sprintf("bench-%s-%d", replayKey, seq.Add(1)), http.StatusCreated)
		}},
		{"replay", func(b *testing.B) { post(b, idemSrv.URL, replayKey, http.StatusCreated) }},
		{"single", func(b *testing.B) {
			post(b, singleSrv.URL, fmt.Sprintf("bench-%s-%d", replayKey, seq.Add(1)), http.StatusCreated)
		}},
		{"claim", func(b *testing.B) {
			post(b, claimSrv.URL, fmt.Sprintf("bench-%s-%d", replayKey, seq.Add(1)), http.StatusCreated)
		}},
	}
	for _, m := range modes {
		for _, clients := range []int{1, 8, 32} {
			b.Run(fmt.Sprintf("mode=%s/clients=%d", m.name, clients), func(b *testing.B) {
				defer cpuPerOp(b)()
				if clients == 1 {
					for b.Loop() {
						m.do(b)
					}
					return
				}
				b.SetParallelism((clients + runtime.GOMAXPROCS(0) - 1) / runtime.GOMAXPROCS(0))
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						m.do(b)
					}
				})
			})
		}
	}
}

// cpuPerOp reports the process's CPU time per operation (user and system) as
// cpu-ns/op; call the returned function after the loop.
func cpuPerOp(b *testing.B) func() {
	start := cpuTime()
	return func() {
		b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op")
	}
}

func cpuTime() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}

func writeOrder(w http.ResponseWriter, id int64) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"item":"bench"}`, id)
}
