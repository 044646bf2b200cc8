package mysqlstore_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepPoolExhaustedSaysSo: single-transaction flow, a pool of 4
// connections (SetMaxOpenConns) and 4 requests whose handlers each hold one
// for their transaction when they reach their step: no connection can come
// free for a step's statement. The steps give up within seconds with an error
// that says to raise SetMaxOpenConns (the handler answers 502, the
// transactions roll back; a step still waiting when another gave up may take
// the connection that freed, and answer 201), and the retries, one at a time,
// succeed. A hang fails it: the client gives up after 30 s, and the requests
// must all have answered within 20 s.
func TestStepPoolExhaustedSaysSo(t *testing.T) { bothModes(t, testStepPoolExhaustedSaysSo) }

func testStepPoolExhaustedSaysSo(t *testing.T) {
	const n = 4
	db := openDB(t, n, "")
	s := newStore(t, db)
	var entered sync.WaitGroup
	entered.Add(n)
	var once sync.Map
	srv := newServer(t, s, &idem.Config{Flow: idem.FlowSingleTx, KeepFunc: func(s int) bool { return s < 500 }},
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
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
		}))
	post := func(key string) (int, string) {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
		if err != nil {
			t.Error(err)
			return 0, ""
		}
		req.Header.Set("Idempotency-Key", key)
		client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
		resp, err := client.Do(req)
		if err != nil {
			t.Errorf("POST %s: %v", key, err)
			return 0, ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	prefix := randomName("pool-")
	start := time.Now()
	type answer struct {
		status int
		body   string
	}
	res := make(chan answer, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, b := post(fmt.Sprintf("%s-%d", prefix, i))
			res <- answer{st, b}
		}()
	}
	wg.Wait()
	close(res)
	refused := 0
	for a := range res {
		switch {
		case a.status == http.StatusBadGateway && strings.Contains(a.body, "SetMaxOpenConns"):
			refused++
		case a.status == http.StatusCreated:
		default:
			t.Errorf("a request whose step found no free connection got %d %s, want 502 saying to raise SetMaxOpenConns (or 201 once another gave up)", a.status, a.body)
		}
	}
	if refused == 0 {
		t.Errorf("no step gave up, though all %d connections were held by the handlers' transactions", n)
	}
	if d := time.Since(start); d > 20*time.Second {
		t.Errorf("the requests took %v", d)
	}
	for i := range n {
		if st, b := post(fmt.Sprintf("%s-%d", prefix, i)); st != http.StatusCreated {
			t.Errorf("retry %d alone: %d %s", i, st, b)
		}
	}
}
