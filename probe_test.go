package idem_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// A handler that hands its context to goroutines which outlive it: the
// context ends (Canceled, cause Canceled) once the handler returned, the same
// Done channel for every goroutine, whether they first looked at it before the
// end or after (the other half looked before the handler returned), and it still answers the request's values and its deadline.
func TestHandlerContextKeptAfterReturn(t *testing.T) {
	type ctxKey struct{}
	const lookers = 8
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		dones   = map[string]map[<-chan struct{}]bool{}
		errs    []string
		release = make(chan struct{})
	)
	note := func(format string, args ...any) {
		mu.Lock()
		defer mu.Unlock()
		errs = append(errs, fmt.Sprintf(format, args...))
	}
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		want, _ := ctx.Deadline()
		key := r.Header.Get("Idempotency-Key")
		mu.Lock()
		dones[key] = map[<-chan struct{}]bool{}
		mu.Unlock()
		var looked sync.WaitGroup
		for i := range lookers {
			if i%2 == 1 {
				looked.Add(1)
			}
			wg.Go(func() {
				if i%2 == 0 {
					<-release // half look first after the handler returned
				}
				done := ctx.Done()
				mu.Lock()
				dones[key][done] = true
				mu.Unlock()
				if i%2 == 1 {
					looked.Done()
				}
				<-release
				select {
				case <-done:
				case <-time.After(10 * time.Second):
					note("goroutine %d: the context did not end 10 s after the handler returned", i)
					return
				}
				if err := ctx.Err(); !errors.Is(err, context.Canceled) {
					note("goroutine %d: Err = %v, want Canceled", i, err)
				}
				if c := context.Cause(ctx); !errors.Is(c, context.Canceled) {
					note("goroutine %d: Cause = %v, want Canceled", i, c)
				}
				if v := ctx.Value(ctxKey{}); v != "request value" {
					note("goroutine %d: Value = %v", i, v)
				}
				if d, ok := ctx.Deadline(); !ok || !d.Equal(want) {
					note("goroutine %d: Deadline = %v %v, want %v", i, d, ok, want)
				}
			})
		}
		looked.Wait() // the other half looked before the handler returned
		w.WriteHeader(http.StatusCreated)
	})
	store := newMem(t)
	mw, err := idem.New(store, &idem.Config{HandlerTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveLoopback(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mw(handler).ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxKey{}, "request value")))
	}))
	for i := range 3 {
		if code := postStatus(t, srv, fmt.Sprintf("kept-%d", i)); code != http.StatusCreated {
			t.Fatalf("status %d", code)
		}
	}
	close(release)
	wg.Wait()
	for _, e := range errs {
		t.Error(e)
	}
	for key, chans := range dones {
		if len(chans) != 1 {
			t.Errorf("%s: %d distinct Done channels, want one for all the request's goroutines", key, len(chans))
		}
	}
}

// Responses stored concurrently (their memory pooled when the store copies
// them) replay exactly as each was answered, headers and body, while replays
// and an Observer run alongside.
func TestConcurrentStoredResponsesStayApart(t *testing.T) {
	const clients, rounds = 8, 40
	var observed sync.Map
	obs := idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		if e.Kind == idem.EventExecuted {
			observed.Store(e.Key, e.Status)
		}
	})
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		w.Header().Set("Content-Type", "text/plain; k="+key)
		w.Header()["Link"] = []string{"<a/" + key + ">", strings.Repeat("l", len(key)%7) + key, ""}
		w.Header().Set("Location", "/orders/"+key)
		w.Header().Set("Etag", `"`+key+`"`)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("body of " + key))
	})
	store := newMem(t)
	mw, err := idem.New(store, &idem.Config{Observer: obs, StoredHeaders: []string{"Content-Type", "Link", "Location", "Etag"}})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveLoopback(t, mw(handler))
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			for i := range rounds {
				key := fmt.Sprintf("apart-%d-%d", c, i)
				for replay := range 2 {
					a := postAnswer(t, srv, key)
					wantLink := []string{"<a/" + key + ">", strings.Repeat("l", len(key)%7) + key, ""}
					if a.status != http.StatusCreated || string(a.body) != "body of "+key ||
						a.header.Get("Location") != "/orders/"+key || a.header.Get("Etag") != `"`+key+`"` ||
						a.header.Get("Content-Type") != "text/plain; k="+key ||
						strings.Join(a.header["Link"], "|") != strings.Join(wantLink, "|") ||
						(a.header.Get(idem.ReplayedHeader) == "true") != (replay == 1) {
						t.Errorf("%s (replay %v): %d %v %q", key, replay == 1, a.status, a.header, a.body)
						return
					}
				}
			}
		})
	}
	wg.Wait()
	n := 0
	observed.Range(func(any, any) bool { n++; return true })
	if n != clients*rounds {
		t.Errorf("%d executions observed, want %d", n, clients*rounds)
	}
}

func newMem(t *testing.T) *memstore.Store {
	t.Helper()
	s := memstore.New(nil)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// serveLoopback serves h on a real loopback socket.
func serveLoopback(t *testing.T, h http.Handler) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

func postAnswer(t *testing.T, srv *httptest.Server, key string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
	if err != nil {
		t.Error(err)
		return answer{}
	}
	req.Header.Set("Idempotency-Key", key)
	// One attempt per request (see setup).
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Error(err)
		return answer{}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Error(err)
	}
	return answer{resp.StatusCode, resp.Header, body}
}

func postStatus(t *testing.T, srv *httptest.Server, key string) int {
	t.Helper()
	return postAnswer(t, srv, key).status
}
