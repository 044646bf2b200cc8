package idem_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepsManyRequestsAtOnce: many keys, two requests each, all released at
// the same moment, every handler running two steps, on SQLite and PostgreSQL
// in both flows: no request fails with a store error (SQLite keeps step
// records in a file of its own, whose writes must not wait on the handlers'
// transactions), and in the end each key's steps each ran once and each key
// answers 201.
func TestStepsManyRequestsAtOnce(t *testing.T) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run("sqlite-"+flow.String(), func(t *testing.T) {
			t.Parallel()
			manyAtOnce(t, newSQLiteStore(t), flow, 24)
		})
		t.Run("postgres-"+flow.String(), func(t *testing.T) {
			t.Parallel()
			// Two connections per request at once (its transaction, its
			// step), as pgstore's docs ask.
			manyAtOnce(t, newPGStoreConns(t, 2*2*6+2), flow, 6)
		})
	}
}

func manyAtOnce(t *testing.T, store idem.Store, flow idem.Flow, keys int) {
	{
		mw, err := idem.New(store, &idem.Config{Flow: flow, KeepFunc: func(s int) bool { return s < 500 }})
		if err != nil {
			t.Fatal(err)
		}
		var mu sync.Mutex
		calls := map[string]int{}
		srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, k, _ := idem.KeyFrom(r.Context())
			for _, name := range []string{"charge", "ship"} {
				if _, err := idem.Step(r.Context(), name, func(ctx context.Context, key string) (string, error) {
					mu.Lock()
					calls[k+"/"+name]++
					mu.Unlock()
					time.Sleep(5 * time.Millisecond)
					return key, nil
				}); err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
			}
			w.WriteHeader(http.StatusCreated)
		})))
		const each = 2
		start := make(chan struct{})
		var wg sync.WaitGroup
		res := make(chan answer, keys*each)
		for i := range keys {
			for range each {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					res <- postAnswer(t, srv, fmt.Sprintf("many-%d", i))
				}()
			}
		}
		close(start)
		wg.Wait()
		close(res)
		for a := range res {
			if a.status != http.StatusCreated && a.status != http.StatusConflict {
				t.Errorf("a concurrent request got %d %s", a.status, a.body)
			}
		}
		for i := range keys {
			key := fmt.Sprintf("many-%d", i)
			var a answer
			for range 100 {
				if a = postAnswer(t, srv, key); a.status != http.StatusConflict {
					break
				}
				time.Sleep(20 * time.Millisecond)
			}
			if a.status != http.StatusCreated {
				t.Errorf("%s finally answers %d %s", key, a.status, a.body)
			}
		}
		mu.Lock()
		defer mu.Unlock()
		for k, n := range calls {
			if n != 1 {
				t.Errorf("%s ran %d times", k, n)
			}
		}
		if len(calls) != 2*keys {
			t.Errorf("%d steps ran, want %d", len(calls), 2*keys)
		}
	}
}

// TestStepPoolExhaustedSaysSo: PostgreSQL, single-transaction flow, a pool
// of 4 connections and 4 requests whose handlers each hold one for their
// transaction when they reach their step: no connection can come free for
// a step's statement. The steps give up within seconds with an error that
// says to raise MaxConns (the handler answers 502, the transactions roll
// back; a step still waiting when another gave up may take the connection
// that freed), and the retries, one at a time, succeed. Failed before the fix:
// the four requests hung until the client gave up (30 s), their steps
// waiting for a connection that only their own handlers could free.
func TestStepPoolExhaustedSaysSo(t *testing.T) {
	t.Parallel()
	const n = 4
	store := newPGStoreConns(t, n)
	mw, err := idem.New(store, &idem.Config{Flow: idem.FlowSingleTx, KeepFunc: func(s int) bool { return s < 500 }})
	if err != nil {
		t.Fatal(err)
	}
	var entered sync.WaitGroup
	entered.Add(n)
	var once sync.Map
	srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, k, _ := idem.KeyFrom(r.Context())
		if _, loaded := once.LoadOrStore(k, true); !loaded {
			entered.Done()
			entered.Wait() // all n handlers hold their transaction's connection
		}
		if _, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (string, error) { return key, nil }); err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	start := time.Now()
	var wg sync.WaitGroup
	res := make(chan answer, n)
	for i := range n {
		wg.Add(1)
		go func() { defer wg.Done(); res <- postAnswer(t, srv, fmt.Sprintf("pool-%d", i)) }()
	}
	wg.Wait()
	close(res)
	// The first step to give up rolls its transaction back and frees its
	// connection, which a step still waiting may then take (a 201): what must
	// never happen is a hang, or a refusal that does not say what to do.
	refused := 0
	for a := range res {
		switch {
		case a.status == http.StatusBadGateway && strings.Contains(string(a.body), "size pgxpool's MaxConns"):
			refused++
		case a.status == http.StatusCreated:
		default:
			t.Errorf("a request whose step found no free connection got %d %s, want 502 saying to raise MaxConns (or 201 once another gave up)", a.status, a.body)
		}
	}
	if refused == 0 {
		t.Errorf("no step gave up, though all %d connections were held by the handlers' transactions", n)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("the requests took %v", d)
	}
	for i := range n {
		if a := postAnswer(t, srv, fmt.Sprintf("pool-%d", i)); a.status != http.StatusCreated {
			t.Errorf("retry pool-%d alone: %d %s", i, a.status, a.body)
		}
	}
}
