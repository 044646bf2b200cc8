package redisstore_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestStepOtherRequestLargeBody (loopback HTTP): the first request charges 10
// as a step and is answered 503 (the key released, the step recorded); the
// key is then sent with another body, whose handler ignores
// ErrStepOtherRequest and writes 201 with a body larger than MaxStoredBody.
// Redis has no transactions, so such a body would stream and be stored as
// complete, without it, under the second request: the middleware answers 422
// instead, stores nothing, and the first request retried gets 201 with its
// recorded charge (one provider call). Failed before: 201 for the second
// request, then 422 for the first.
func TestStepOtherRequestLargeBody(t *testing.T) {
	b := setup(t)
	mw, err := idem.New(b.store, &idem.Config{MaxStoredBody: 1 << 10, KeepFunc: func(s int) bool { return s < 500 }})
	if err != nil {
		t.Fatal(err)
	}
	var calls atomic.Int32
	var fail atomic.Bool
	fail.Store(true)
	var stepErr atomic.Value
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct{ Amount int }
		_ = json.NewDecoder(r.Body).Decode(&in)
		charged, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (int, error) {
			calls.Add(1)
			return in.Amount, nil
		})
		if err != nil {
			stepErr.Store(err)
		}
		if fail.Load() {
			http.Error(w, "the database went away", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order of %d paid by the charge of %d;", in.Amount, charged)
		if in.Amount != 10 {
			_, _ = io.WriteString(w, strings.Repeat("x", 64<<10))
		}
	})))
	t.Cleanup(srv.Close)
	post := func(body string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(body))
		req.Header.Set("Idempotency-Key", "large-other")
		resp, err := (&http.Client{Timeout: 30 * time.Second}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		out, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(out)
	}
	if st, body := post(`{"amount":10}`); st != http.StatusServiceUnavailable {
		t.Fatalf("first request: %d %.80s", st, body)
	}
	fail.Store(false)
	st, body := post(`{"amount":20}`)
	var p idem.Problem
	_ = json.Unmarshal([]byte(body), &p)
	if st != http.StatusUnprocessableEntity || p.Code != idem.CodeKeyReused {
		t.Errorf("another request writing a large body: %d %.80s; want 422 %s", st, body, idem.CodeKeyReused)
	}
	if err, _ := stepErr.Load().(error); !errors.Is(err, idem.ErrStepOtherRequest) {
		t.Errorf("Step returned %v, want ErrStepOtherRequest", err)
	}
	if st, body := post(`{"amount":10}`); st != http.StatusCreated || body != "order of 10 paid by the charge of 10;" || calls.Load() != 1 {
		t.Errorf("the first request retried: %d %.80s, %d calls; want 201 with the recorded charge, one call", st, body, calls.Load())
	}
}
