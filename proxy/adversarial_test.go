package proxy_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/proxy"
)

// TestEscapedPathSegmentsAreKeyed: a router that splits the path as the client
// escaped it and unescapes each segment (Express, Rails, net/http's ServeMux)
// sends PATCH /orders/a%2Fb (id "a/b") and /orders/%2e%2e (id "..") to
// PATCH /orders/{id}. Before, the proxy matched only the decoded path
// ("/orders/a/b", "/" once cleaned), so both bypassed the route: two requests
// with one key ran twice, and a keyless one was forwarded.
func TestEscapedPathSegmentsAreKeyed(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("PATCH /orders/{id}", func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		fmt.Fprintf(w, "patched %q", r.PathValue("id"))
	})
	up := httptest.NewServer(mux)
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "PATCH /orders/{id}"}}})
	for i, p := range []string{"/orders/a%2Fb", "/orders/%2e%2e", "/orders/%2E", "/orders/%2Forders"} {
		before := runs.Load()
		for j := range 2 {
			if a := send(t, "PATCH", px.url+p, `{}`, "Idempotency-Key", fmt.Sprint("escaped-", i)); a.status != 200 || (j == 1) != (a.header.Get(idem.ReplayedHeader) == "true") {
				t.Errorf("PATCH %s, attempt %d: %d %v %s, want 200 (the second replayed)", p, j+1, a.status, a.header, a.body)
			}
		}
		if n := runs.Load() - before; n != 1 {
			t.Errorf("PATCH %s twice with one key: the upstream ran %d times, want 1", p, n)
		}
		wantProblem(t, send(t, "PATCH", px.url+p, `{}`), 400, idem.CodeKeyMissing)
	}
	// What the upstream routes elsewhere stays unkeyed.
	if a := send(t, "PATCH", px.url+"/orders/a%2Fb/c", `{}`); a.status != 404 {
		t.Errorf("PATCH /orders/a%%2Fb/c without a key: %d %s, want the upstream's 404", a.status, a.body)
	}
}
