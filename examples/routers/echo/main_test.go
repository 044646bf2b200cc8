package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/examples/routers/internal/routertest"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
)

// TestIdemCheck runs every case of idem check against the Echo server.
func TestIdemCheck(t *testing.T) {
	e, err := newServer(memstore.New(nil), &shop.Orders{Delay: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(e)
	defer srv.Close()
	routertest.Check(t, srv.URL+"/orders", srv.URL+"/orders?cart_id={{marker}}")
}

// TestReturnedErrorIsStored: a handler's returned error (a 400 for a bad
// order) is rendered inside idem, so it is stored and replayed, not an empty 200.
func TestReturnedErrorIsStored(t *testing.T) {
	e, err := newServer(memstore.New(nil), &shop.Orders{})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(e)
	defer srv.Close()
	post := func() (*http.Response, string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"cart_id":"","total_cents":0}`))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Authorization", "Bearer t1")
		req.Header.Set("Idempotency-Key", "bad-order")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var sb strings.Builder
		_, _ = io.Copy(&sb, resp.Body)
		return resp, sb.String()
	}
	a, abody := post()
	b, bbody := post()
	if a.StatusCode != http.StatusBadRequest || b.StatusCode != http.StatusBadRequest || b.Header.Get("Idempotent-Replayed") != "true" || abody != bbody || !strings.Contains(abody, "cart_id") {
		t.Fatalf("bad order twice: %d %q, then %d %q (replayed %q); want the 400 stored and replayed", a.StatusCode, abody, b.StatusCode, bbody, b.Header.Get("Idempotent-Replayed"))
	}
}
