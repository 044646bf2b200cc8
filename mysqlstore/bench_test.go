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
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
)

// BenchmarkOrder measures a handler that inserts one order, over loopback HTTP:
//
//	mode=bare    the handler runs its own READ COMMITTED transaction, no idem
//	mode=first   through idem, a new key per request (claim, transaction, completion)
//	mode=replay  through idem, one key already complete (one read)
//	mode=single  through idem with idem.FlowSingleTx, a new key per request
//
// at 1 and 32 concurrent clients. Compare the modes with
//
//	go test -run '^$' -bench BenchmarkOrder -benchtime 1s -count 6 ./mysqlstore/ > new.txt
//	benchstat -col /mode new.txt
func BenchmarkOrder(b *testing.B) {
	db := openDB(b, 40, "&interpolateParams=true")
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
		res, err := mysqlstore.Tx(r.Context()).ExecContext(r.Context(), insert, "bench")
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
	}
	for _, m := range modes {
		for _, clients := range []int{1, 32} {
			b.Run(fmt.Sprintf("mode=%s/clients=%d", m.name, clients), func(b *testing.B) {
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

func writeOrder(w http.ResponseWriter, id int64) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"item":"bench"}`, id)
}
