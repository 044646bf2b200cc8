package proxy_test

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"
	"time"

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

// methodOverride is what Express's method-override, Rack, Symfony and
// ASP.NET Core do before routing: a POST with X-HTTP-Method-Override (or, in
// Symfony and Laravel, a _method query parameter) is taken for that method.
func methodOverride(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPost {
			if m := r.Header.Get("X-HTTP-Method-Override"); m != "" {
				r.Method = strings.ToUpper(m)
			} else if m := r.URL.Query().Get("_method"); m != "" {
				r.Method = strings.ToUpper(m)
			}
		}
		next.ServeHTTP(w, r)
	})
}

// TestMethodOverrideIsKeyed: a POST that the upstream's framework takes for a
// PATCH (X-HTTP-Method-Override, ?_method=PATCH) reaches PATCH /orders/{id},
// so it is keyed there. Before, it matched no keyed route (the route keys
// PATCH) and passed through unprotected: two requests with one key ran twice.
// And a route that keys the request's method wins over one that matches the
// path only: PUT /payments/ is PUT /payments, not the method-less /payments/
// subtree (which keys POST and PATCH).
func TestMethodOverrideIsKeyed(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	mux := http.NewServeMux()
	count := func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		fmt.Fprintf(w, "%s %s", r.Method, r.URL.Path)
	}
	mux.HandleFunc("PATCH /orders/{id}", count)
	mux.HandleFunc("PUT /payments/", count)
	up := httptest.NewServer(methodOverride(mux))
	t.Cleanup(up.Close)
	var unrouted atomic.Int64
	px := startProxy(t, up.URL, proxy.Config{
		Routes:     []proxy.Route{{Pattern: "PATCH /orders/{id}"}, {Pattern: "/payments/"}, {Pattern: "PUT /payments"}},
		OnUnrouted: func(string, string) { unrouted.Add(1) },
	})
	cases := []struct {
		method, path string
		header       []string
	}{
		{"POST", "/orders/1", []string{"X-HTTP-Method-Override", "PATCH"}},
		{"POST", "/orders/2", []string{"X-HTTP-Method-Override", "patch"}},
		{"POST", "/orders/3?_method=PATCH", nil},
		{"POST", "/orders/4?%5Fmethod=patch", nil},
		{"PUT", "/payments/", nil},
	}
	for i, c := range cases {
		before := runs.Load()
		for j := range 2 {
			h := append([]string{"Idempotency-Key", fmt.Sprint("override-", i)}, c.header...)
			if a := send(t, c.method, px.url+c.path, `{"amount":1}`, h...); a.status != 200 || (j == 1) != (a.header.Get(idem.ReplayedHeader) == "true") {
				t.Errorf("%s %s %v, attempt %d: %d %v %s, want 200 (the second replayed)", c.method, c.path, c.header, j+1, a.status, a.header, a.body)
			}
		}
		if n := runs.Load() - before; n != 1 {
			t.Errorf("%s %s %v twice with one key: the upstream ran %d times, want 1", c.method, c.path, c.header, n)
		}
		if a := send(t, c.method, px.url+c.path, `{"amount":1}`, c.header...); a.status != 400 {
			t.Errorf("%s %s %v without a key: %d %s, want 400 idempotency_key_missing", c.method, c.path, c.header, a.status, a.body)
		}
	}
	if n := unrouted.Load(); n != 0 {
		t.Errorf("%d requests counted as unrouted, want 0", n)
	}
	// A plain POST on the PATCH route is not keyed (the upstream answers 405).
	if a := send(t, "POST", px.url+"/orders/1", `{}`); a.status != 405 {
		t.Errorf("POST /orders/1 without a key or an override: %d %s, want the upstream's 405", a.status, a.body)
	}
}

// TestSpoofedForwardingHeadersAreRemoved: gunicorn (secure_scheme_headers,
// forwarded_allow_ips 127.0.0.1) and Rails (trusted proxies include loopback)
// take X-Forwarded-Ssl: on, X-Forwarded-Protocol: ssl or X-Forwarded-Scheme
// from the proxy's address as "the client used https", and X-Real-IP as the
// client's address. Before, a client's own such headers passed through,
// although X-Forwarded-Proto and -Host from an untrusted peer are replaced;
// now they pass from a trusted hop only.
func TestSpoofedForwardingHeadersAreRemoved(t *testing.T) {
	t.Parallel()
	seen := make(chan http.Header, 4)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	spoof := []string{"X-Forwarded-Ssl", "on", "X-Forwarded-Scheme", "https", "X-Forwarded-Protocol", "ssl", "X-Forwarded-Port", "443",
		"X-Forwarded-Prefix", "/evil", "X-Url-Scheme", "https", "Front-End-Https", "on", "X-Real-IP", "203.0.113.9", "X-Forwarded-Server", "gw"}
	for _, trusted := range []bool{false, true} {
		cfg := proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}}
		if trusted {
			cfg.TrustForwarded = []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
		}
		px := startProxy(t, up.URL, cfg)
		for _, key := range []string{"spoof", ""} { // keyed, and unkeyed (passed through)
			h := spoof
			method := "POST"
			if key != "" {
				h = append([]string{"Idempotency-Key", key}, spoof...)
			} else {
				method = "PUT"
			}
			if a := send(t, method, px.url+"/orders", `{}`, h...); a.status != 201 {
				t.Fatalf("trusted %v, %s: %d %s", trusted, method, a.status, a.body)
			}
			got := <-seen
			for i := 0; i < len(spoof); i += 2 {
				if v := got.Get(spoof[i]); (v == spoof[i+1]) != trusted {
					t.Errorf("trusted hop %v, %s: the upstream received %s %q", trusted, method, spoof[i], v)
				}
			}
		}
	}
}

// TestUnroutedKeyedRequestIsNotResent: a request that carries an
// Idempotency-Key but matches no keyed route goes upstream unprotected, on a
// pooled connection. net/http's Transport treats a bodiless request with that
// header as replayable, and re-sends it on a new connection when a reused one
// fails after the request was written: the proxy itself then ran the
// operation twice. The upstream here reads the second request on a
// connection, then closes it without answering (a crash mid-request).
func TestUnroutedKeyedRequestIsNotResent(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	var deletes atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				br := bufio.NewReader(c)
				for n := 0; ; n++ {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					_, _ = io.Copy(io.Discard, req.Body)
					if req.Method == http.MethodDelete && req.Header.Get("Idempotency-Key") == "delete-once" {
						deletes.Add(1)
					}
					if n == 1 {
						return // the second request on a connection: read, then the connection drops
					}
					_, _ = io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
				}
			}()
		}
	}()
	// The pooled connection stays idle long enough on a loaded machine.
	px := startProxy(t, "http://"+ln.Addr().String(), proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}, UpstreamIdleTimeout: time.Minute})
	// The DELETE goes upstream on the connection the GET left idle.
	tr := &http.Transport{MaxConnsPerHost: 1}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	resp, err := c.Get(px.url + "/warm")
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	req, _ := http.NewRequest(http.MethodDelete, px.url+"/orders/1", nil)
	req.Header.Set("Idempotency-Key", "delete-once")
	if resp, err := c.Do(req); err == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway {
			t.Errorf("DELETE whose connection dropped after it was read: %d, want 502", resp.StatusCode)
		}
	}
	if n := deletes.Load(); n != 1 {
		t.Errorf("one DELETE sent: the upstream read it %d times, want 1", n)
	}
}

// TestBodilessKeyedRequestOnACustomTransportIsNotChunked: with a Transport
// of the caller's, a keyed POST without a body went upstream chunked (the
// proxy gave it a body of unknown length, so that net/http would not re-send
// it), which upstreams that read by Content-Length cannot parse.
func TestBodilessKeyedRequestOnACustomTransportIsNotChunked(t *testing.T) {
	t.Parallel()
	seen := make(chan string, 2)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- fmt.Sprintf("TE %v, Content-Length %q, key %q", r.TransferEncoding, r.Header.Get("Content-Length"), r.Header.Get("Idempotency-Key"))
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	px := startProxy(t, up.URL, proxy.Config{Transport: tr})
	for i := range 2 {
		if a := send(t, "POST", px.url+"/orders", "", "Idempotency-Key", "bodiless"); a.status != 201 {
			t.Fatalf("attempt %d: %d %s", i+1, a.status, a.body)
		}
	}
	if got, want := <-seen, `TE [], Content-Length "0", key "bodiless"`; got != want {
		t.Errorf("the upstream received %s, want %s", got, want)
	}
	if len(seen) != 0 {
		t.Errorf("the upstream ran the request twice: %s", <-seen)
	}
}

// TestKeyUnroutedKeysOnlyItsMethods: strict mode keys POST, PUT, PATCH and
// DELETE on no route; another method with a key (PURGE, a WebDAV MKCOL) is
// passed through, as without strict mode. Before, it was sent through the
// key checks anyway: without a scope it got 401, and the warning said "keyed
// anyway".
func TestKeyUnroutedKeysOnlyItsMethods(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(200)
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}, KeyUnrouted: true, Scope: proxy.HeaderScope("X-Tenant-ID")})
	for _, m := range []string{"PURGE", "MKCOL"} {
		if a := send(t, m, px.url+"/cache/x", "", "Idempotency-Key", "k-"+m); a.status != 200 {
			t.Errorf("%s with a key on no route, strict mode: %d %s, want the upstream's 200", m, a.status, a.body)
		}
	}
	wantProblem(t, send(t, "PUT", px.url+"/cache/x", "", "Idempotency-Key", "k-put"), 401, proxy.CodeScopeMissing)
	if n := runs.Load(); n != 2 {
		t.Errorf("the upstream ran %d requests, want 2", n)
	}
}

// TestForwardedOnlyGateway: a trusted gateway that says how the client came
// in with Forwarded only (RFC 7239: proto=https;host=shop.example) and no
// X-Forwarded-Proto/-Host. Before, the upstream got X-Forwarded-Proto: http
// and the proxy's host (Django's SECURE_SSL_REDIRECT then redirects in a loop),
// and a Location naming the upstream was rewritten to http://<proxy>.
func TestForwardedOnlyGateway(t *testing.T) {
	t.Parallel()
	seen := make(chan http.Header, 2)
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen <- r.Header.Clone()
		w.Header().Set("Location", "http://"+r.Host+"/orders/1")
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{TrustForwarded: []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}})
	a := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "fwd-only", "Forwarded", `for=198.51.100.1;proto=http, for=203.0.113.7;proto=https;host="shop.example"`)
	if loc := a.header.Get("Location"); a.status != 201 || loc != "https://shop.example/orders/1" {
		t.Errorf("%d, Location %q, want 201 with https://shop.example/orders/1", a.status, loc)
	}
	h := <-seen
	if h.Get("X-Forwarded-Proto") != "https" || h.Get("X-Forwarded-Host") != "shop.example" || !strings.HasSuffix(h.Get("Forwarded"), ", for=127.0.0.1") {
		t.Errorf("the upstream received X-Forwarded-Proto %q, X-Forwarded-Host %q, Forwarded %q; want https, shop.example and the peer appended",
			h.Get("X-Forwarded-Proto"), h.Get("X-Forwarded-Host"), h.Get("Forwarded"))
	}
}

// TestKeyedRequestsToAnHTTP2UpstreamUseFreshConnections: an https upstream
// that speaks HTTP/2 (ALPN h2: Envoy, Caddy, Node's http2, a Go server).
// Before, keyed requests went over one shared HTTP/2 connection, reused like
// any pooled one, so the "new connection per keyed request" that keeps an
// idle-closing upstream from stranding keys did not hold; now they speak
// HTTP/1.1 on a connection of their own. Unkeyed requests keep HTTP/2.
func TestKeyedRequestsToAnHTTP2UpstreamUseFreshConnections(t *testing.T) {
	t.Parallel()
	type seen struct {
		proto  int
		remote string
	}
	got := make(chan seen, 8)
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got <- seen{r.ProtoMajor, r.RemoteAddr}
		w.WriteHeader(201)
	}))
	up.EnableHTTP2 = true
	up.StartTLS()
	t.Cleanup(up.Close)
	pool := x509.NewCertPool()
	pool.AddCert(up.Certificate())
	px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}, UpstreamTLS: &tls.Config{RootCAs: pool, ServerName: "example.com"}})
	remotes := map[string]bool{}
	for i := range 3 {
		if a := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", fmt.Sprint("h2-", i)); a.status != 201 {
			t.Fatalf("keyed POST %d: %d %s", i, a.status, a.body)
		}
		s := <-got
		if s.proto != 1 {
			t.Errorf("keyed POST %d reached the upstream over HTTP/%d, want HTTP/1.1", i, s.proto)
		}
		remotes[s.remote] = true
	}
	if len(remotes) != 3 {
		t.Errorf("3 keyed requests came on %d connections, want 3", len(remotes))
	}
	if a := send(t, "GET", px.url+"/orders", ""); a.status != 201 {
		t.Fatalf("unkeyed GET: %d %s", a.status, a.body)
	}
	if s := <-got; s.proto != 2 {
		t.Errorf("an unkeyed request reached the upstream over HTTP/%d, want HTTP/2 (pooled)", s.proto)
	}
}
