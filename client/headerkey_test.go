package client_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
)

// A caller's key under a header name that is not in canonical form
// (req.Header["idempotency-key"], as an http.Header literal writes it) is the
// caller's key: net/http sends it as it is, so the Transport must not add one
// of its own beside it. Before the fix it did, and every attempt reached the
// server with two Idempotency-Key lines (which idem answers with 400).
func TestNonCanonicalCallerKeyIsTheOnlyKey(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var seen [][]string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		seen = append(seen, r.Header.Values("Idempotency-Key"))
		n := len(seen)
		mu.Unlock()
		if n == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	t.Cleanup(srv.Close)
	tr := fast(http.DefaultTransport, 3)
	tr.KeyFunc = func() string { return "generated" }
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header["idempotency-key"] = []string{"caller-key"}
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	mu.Lock()
	defer mu.Unlock()
	if resp.StatusCode != http.StatusCreated || len(seen) != 2 {
		t.Fatalf("%d after %d attempts, want 201 after 2", resp.StatusCode, len(seen))
	}
	for i, keys := range seen {
		if len(keys) != 1 || keys[0] != "caller-key" {
			t.Errorf("attempt %d sent keys %q, want only the caller's", i+1, keys)
		}
	}
}
