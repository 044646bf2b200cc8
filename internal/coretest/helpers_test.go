package idem_test

// The HTTP helpers these tests share with the core module's own tests, copied
// from the repository root's middleware_test.go and probe_test.go (test files
// of another module cannot be imported). Keep the two copies alike.

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// orders is a small orders handler that counts its executions.
type orders struct {
	runs  atomic.Int64
	delay time.Duration
	// gate, when set, is waited on by every execution before it answers.
	gate chan struct{}
}

func (o *orders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := o.runs.Add(1)
	body, _ := io.ReadAll(r.Body)
	if o.gate != nil {
		<-o.gate
	}
	if o.delay > 0 {
		time.Sleep(o.delay)
	}
	if bytes.Contains(body, []byte("invalid")) {
		w.Header().Set("Content-Type", "application/problem+json")
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprint(w, `{"status":400,"title":"invalid order"}`)
		return
	}
	if bytes.Contains(body, []byte("boom")) {
		w.WriteHeader(http.StatusInternalServerError)
		fmt.Fprintf(w, "failure %d", n)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/"+strconv.FormatInt(n, 10))
	w.Header().Set("Set-Cookie", "session=secret")
	w.Header().Set("X-Not-Stored", "x")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d,"body":%q,"scope":%q}`, n, body, idem.ScopeFrom(r.Context()))
}

type bundle struct {
	store  *memstore.Store
	orders *orders
	server *httptest.Server
	client *http.Client
}

// setup serves o behind idem with cfg on a real loopback socket. A bearer token,
// when sent, becomes the scope.
func setup(t *testing.T, cfg *idem.Config, o *orders) *bundle {
	t.Helper()
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	h := mw(o)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			r = r.WithContext(idem.WithScope(r.Context(), tok))
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	// One attempt per request: Go's Transport re-sends requests that carry an
	// Idempotency-Key when a reused connection drops (docs/design.md §6).
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	return &bundle{store: store, orders: o, server: srv, client: client}
}

type answer struct {
	status int
	header http.Header
	body   []byte
}

func (b *bundle) do(t *testing.T, method, path, body string, header ...string) answer {
	t.Helper()
	req, err := http.NewRequest(method, b.server.URL+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := b.client.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header, got}
}

func (b *bundle) post(t *testing.T, key, body string, header ...string) answer {
	t.Helper()
	if key != "" {
		header = append(header, "Idempotency-Key", key)
	}
	return b.do(t, http.MethodPost, "/orders", body, header...)
}

func wantProblem(t *testing.T, a answer, status int, code string) idem.Problem {
	t.Helper()
	if a.status != status {
		t.Fatalf("status = %d, want %d (body %s)", a.status, status, a.body)
	}
	if ct := a.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Errorf("Content-Type = %q, want application/problem+json", ct)
	}
	var p idem.Problem
	if err := json.Unmarshal(a.body, &p); err != nil {
		t.Fatalf("problem body %s: %v", a.body, err)
	}
	if p.Code != code || p.Status != status || p.Type != idem.ProblemTypeBase+code || p.Title == "" || p.Detail == "" {
		t.Errorf("problem = %+v, want code %s, status %d, type, title and detail", p, code, status)
	}
	return p
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
