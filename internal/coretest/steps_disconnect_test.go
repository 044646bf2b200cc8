package idem_test

import (
	"context"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepClientDisconnectsMidStep: the client hangs up while the step's
// call is under way (the call itself goes on and succeeds). The outcome is
// recorded all the same — Step records on a context of its own — and the
// retry, on SQLite and PostgreSQL in both flows, gets the order without a
// second call.
func TestStepClientDisconnectsMidStep(t *testing.T) {
	fpStores(t, func(t *testing.T, store idem.Store, flow idem.Flow) {
		mw, err := idem.New(store, &idem.Config{Flow: flow, KeepFunc: func(s int) bool { return s < 500 }})
		if err != nil {
			t.Fatal(err)
		}
		var calls atomic.Int32
		inStep := make(chan struct{}, 4)
		handlerDone := make(chan struct{}, 4)
		srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			defer func() { handlerDone <- struct{}{} }()
			id, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (string, error) {
				inStep <- struct{}{}
				time.Sleep(300 * time.Millisecond) // the provider answers after the client left
				calls.Add(1)
				return "ch_" + key[5:13], nil
			})
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadGateway)
				return
			}
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(id))
		})))
		ctx, cancel := context.WithCancel(context.Background())
		req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
		key := "disc-" + flow.String()
		req.Header.Set("Idempotency-Key", key)
		go func() { <-inStep; cancel() }()
		if resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req); err == nil {
			resp.Body.Close()
			t.Fatalf("the request was answered %d although the client hung up", resp.StatusCode)
		}
		<-handlerDone
		var a answer
		for range 50 { // the single-tx flow may still be rolling back: 409 meanwhile
			if a = postAnswer(t, srv, key); a.status != http.StatusConflict {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if a.status != http.StatusCreated || calls.Load() != 1 {
			t.Fatalf("retry after the client hung up mid-step: %d %s; provider calls %d; want 201 and one call", a.status, a.body, calls.Load())
		}
	})
}
