package proxy_test

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pyorders"
	"github.com/idemkit/idem/proxy"
)

// sendReq sends req with the test client and reads the answer.
func sendReq(t *testing.T, req *http.Request) answer {
	t.Helper()
	resp, err := client.Do(req)
	if err != nil {
		t.Errorf("%s %s: %v", req.Method, req.URL, err)
		return answer{}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Errorf("read the answer: %v", err)
	}
	return answer{resp.StatusCode, resp.Header, b}
}

// TestChunkedKeyedBodyGoesUpstreamWithContentLength (issue 23 item 1): a
// keyed request whose body came chunked goes to the upstream with a
// Content-Length equal to the bytes fingerprinted and no Transfer-Encoding.
// Before, the body went up chunked: Python's http.server (orders.py) read an
// empty body by its missing Content-Length, answered 400 invalid order (which
// was stored), and read the chunk-size line as its next request.
func TestChunkedKeyedBodyGoesUpstreamWithContentLength(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	px := startProxy(t, app.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}, {Pattern: "POST /headers"}}})
	chunked := func(path, key, body string) answer {
		req, err := http.NewRequest("POST", px.url+path, io.MultiReader(strings.NewReader(body)))
		if err != nil {
			t.Fatal(err)
		}
		req.ContentLength = -1
		req.TransferEncoding = []string{"chunked"}
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Content-Type", "application/json")
		return sendReq(t, req)
	}
	body := `{"cart_id":"chunky","total_cents":1900}`
	for i := range 2 {
		a := chunked("/orders", "chunk-1", body)
		if a.status != 201 || !strings.Contains(string(a.body), `"cart_id": "chunky"`) {
			t.Fatalf("attempt %d: chunked keyed POST: %d %s, want 201 with the order", i+1, a.status, a.body)
		}
	}
	a := chunked("/headers", "chunk-2", body)
	var doc struct{ Headers map[string]string }
	if err := json.Unmarshal(a.body, &doc); a.status != 200 || err != nil {
		t.Fatalf("/headers: %d %s", a.status, a.body)
	}
	if doc.Headers["content-length"] != fmt.Sprint(len(body)) || doc.Headers["transfer-encoding"] != "" {
		t.Errorf("the upstream received Content-Length %q, Transfer-Encoding %q; want %d and none", doc.Headers["content-length"], doc.Headers["transfer-encoding"], len(body))
	}
	// The upstream still parses what comes next (no chunk line read as a request).
	for i := range 5 {
		if a := send(t, "POST", px.url+"/orders", fmt.Sprintf(`{"cart_id":"after-%d"}`, i), "Idempotency-Key", fmt.Sprint("after-", i)); a.status != 201 {
			t.Fatalf("request %d after the chunked one: %d %s", i, a.status, a.body)
		}
	}
	if n := app.Executions(t); n != 6 {
		t.Errorf("upstream executions: %d, want 6", n)
	}
}

// TestIdleClosingUpstreamStrandsNoKey (issue 23 item 2): an upstream that
// closes idle keep-alive connections after 20 ms (as Node.js, gunicorn and
// every rolling restart do, only sooner). Before, about 1 in 10 keyed POSTs
// went out on a connection the upstream was closing, failed with "broken
// pipe" having run nothing, got 502 upstream_failed and left its key
// unresolvable. Now a keyed request never goes out on an idle connection:
// every one runs once and gets its 201.
func TestIdleClosingUpstreamStrandsNoKey(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		if r.Method == "POST" {
			runs.Add(1)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(201)
		fmt.Fprint(w, `{"ok":true}`)
	}))
	up.Config.IdleTimeout = 20 * time.Millisecond
	up.Start()
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}})
	// Keep-alive between the client and the proxy too, as a gateway would.
	kc := &http.Client{Timeout: time.Minute}
	const workers, each = 4, 100
	var wg sync.WaitGroup
	var mu sync.Mutex
	statuses := map[int]int{}
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				// Unkeyed requests keep upstream connections in the pool, and
				// pauses around the upstream's idle timeout race its closes.
				if resp, err := kc.Get(px.url + "/health"); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
				time.Sleep(time.Duration(15+rand.IntN(10)) * time.Millisecond)
				req, _ := http.NewRequest("POST", px.url+"/orders", strings.NewReader(`{"n":1}`))
				req.Header.Set("Idempotency-Key", fmt.Sprintf("idle-%d-%d", w, i))
				resp, err := kc.Do(req)
				if err != nil {
					t.Errorf("POST: %v", err)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				mu.Lock()
				statuses[resp.StatusCode]++
				if resp.StatusCode != 201 && statuses[resp.StatusCode] == 1 {
					t.Logf("first %d: %s", resp.StatusCode, b)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if statuses[201] != workers*each || runs.Load() != workers*each {
		t.Fatalf("%d keyed POSTs to an upstream that closes idle connections: answers %v, %d executions; want every one 201 and run once", workers*each, statuses, runs.Load())
	}
}

// TestUntrustedTLSUpstreamReleasesTheKey (issue 23 item 2): an https upstream
// whose certificate the proxy does not trust never receives the request, so
// the key is released (502 upstream_unreachable) instead of being stranded as
// "outcome unknown". With its CA configured (UpstreamTLS), and the server name
// its certificate names, the request goes through.
func TestUntrustedTLSUpstreamReleasesTheKey(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	up := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}})
	for range 2 {
		a := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "tls")
		wantProblem(t, a, 502, proxy.CodeUpstreamUnreachable)
		if !strings.Contains(string(a.body), "certificate") {
			t.Errorf("the problem does not say why: %s", a.body)
		}
		if _, err := px.store.Get(context.Background(), "", "tls", time.Now()); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("record after a failed TLS handshake: %v, want none (released)", err)
		}
	}
	pool := x509.NewCertPool()
	pool.AddCert(up.Certificate())
	u, _ := url.Parse(up.URL)
	u.Host = strings.Replace(u.Host, "127.0.0.1", "localhost", 1)
	trusted := startProxy(t, u.String(), proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}, UpstreamTLS: tlsConfig(pool, "example.com")})
	if a := send(t, "POST", trusted.url+"/orders", `{}`, "Idempotency-Key", "tls"); a.status != 201 {
		t.Fatalf("with the upstream's CA and server name: %d %s", a.status, a.body)
	}
	if runs.Load() != 1 {
		t.Errorf("upstream executions %d, want 1", runs.Load())
	}
}

// TestNotNowAnswersAreReleased (issue 23 item 3): 429, 408, 425, 401 and 403
// from the upstream are passed on, not kept: the retry that waited as told
// runs. Before, the 429 with Retry-After: 1 was replayed for 24 h. A route's
// ReleaseStatus replaces the list; Release5xx adds the 5xx; and an answer
// that is kept carries its Retry-After and WWW-Authenticate in the replay.
func TestNotNowAnswersAreReleased(t *testing.T) {
	t.Parallel()
	type script struct {
		mu   sync.Mutex
		next []int
		runs int
	}
	s := &script{}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		status := 201
		if len(s.next) > 0 {
			status, s.next = s.next[0], s.next[1:]
		}
		s.runs++
		s.mu.Unlock()
		switch status {
		case 429, 503:
			w.Header().Set("Retry-After", "1")
		case 401:
			w.Header().Set("WWW-Authenticate", `Bearer realm="orders", error="invalid_token"`)
		}
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"status":%d}`, status)
	}))
	t.Cleanup(up.Close)
	run := func(px *fixture, key string, first int) (answer, answer, int) {
		s.mu.Lock()
		s.next, s.runs = []int{first}, 0
		s.mu.Unlock()
		a := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", key)
		b := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", key)
		s.mu.Lock()
		defer s.mu.Unlock()
		return a, b, s.runs
	}
	def := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}})
	for _, status := range []int{401, 403, 408, 425, 429} {
		a, b, runs := run(def, fmt.Sprint("k", status), status)
		if a.status != status || b.status != 201 || b.header.Get(idem.ReplayedHeader) != "" || runs != 2 {
			t.Errorf("upstream %d: answers %d then %d (replayed %q) after %d runs; want %d, then a fresh 201 after 2", status, a.status, b.status, b.header.Get(idem.ReplayedHeader), runs, status)
		}
		if status == 429 && a.header.Get("Retry-After") != "1" {
			t.Errorf("the 429 lost its Retry-After: %v", a.header)
		}
	}
	if a, b, runs := run(def, "k503", 503); b.status != 503 || b.header.Get(idem.ReplayedHeader) != "true" || runs != 1 || b.header.Get("Retry-After") != "1" {
		t.Errorf("default 503: %d then %d (replayed %q, Retry-After %q) after %d runs; want the 503 kept and replayed with its Retry-After", a.status, b.status, b.header.Get(idem.ReplayedHeader), b.header.Get("Retry-After"), runs)
	}
	// An explicit list replaces the default one.
	custom := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders", ReleaseStatus: []int{503}}}})
	if _, b, runs := run(custom, "c503", 503); b.status != 201 || runs != 2 {
		t.Errorf("ReleaseStatus [503]: the retry got %d after %d runs, want a fresh 201", b.status, runs)
	}
	for _, status := range []int{429, 401} {
		a, b, runs := run(custom, fmt.Sprint("c", status), status)
		if b.status != status || b.header.Get(idem.ReplayedHeader) != "true" || runs != 1 {
			t.Errorf("ReleaseStatus [503], upstream %d: retry %d replayed=%q after %d runs, want it kept", status, b.status, b.header.Get(idem.ReplayedHeader), runs)
		}
		for _, h := range []string{"Retry-After", "WWW-Authenticate"} {
			if a.header.Get(h) != b.header.Get(h) {
				t.Errorf("upstream %d: %s %q on the answer, %q on its replay", status, h, a.header.Get(h), b.header.Get(h))
			}
		}
	}
	all5xx := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders", Release5xx: true}}})
	if _, b, runs := run(all5xx, "r502", 502); b.status != 201 || runs != 2 {
		t.Errorf("Release5xx: the retry after a 502 got %d after %d runs, want a fresh 201", b.status, runs)
	}
	if _, b, runs := run(all5xx, "r429", 429); b.status != 201 || runs != 2 {
		t.Errorf("Release5xx keeps the default list too: the retry after a 429 got %d after %d runs", b.status, runs)
	}
	u, _ := url.Parse(up.URL)
	if _, err := proxy.New(proxy.Config{Upstream: u, Store: def.store, Scope: proxy.NoScope(), Routes: []proxy.Route{{Pattern: "POST /x", ReleaseStatus: []int{201}}}}); err == nil || !strings.Contains(err.Error(), "4xx and 5xx") {
		t.Errorf("ReleaseStatus [201]: %v, want an error", err)
	}
}

// looseRouter answers like Express, Django REST framework, ASP.NET and Spring
// on Tomcat: methods in any case, paths in any case, with or without a
// trailing slash, and ";jsessionid=…" path parameters all reach one handler.
type looseRouter struct{ runs atomic.Int64 }

func (l *looseRouter) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p := strings.ToLower(r.URL.Path)
	if i := strings.IndexByte(p, ';'); i >= 0 {
		p = p[:i]
	}
	p = strings.TrimSuffix(path.Clean(p), "/")
	if strings.ToUpper(r.Method) == "POST" && (p == "/orders" || p == "/other") {
		l.runs.Add(1)
		w.WriteHeader(201)
		fmt.Fprint(w, `{"id":"ord"}`)
		return
	}
	w.WriteHeader(404)
}

// TestRouteMatchingDoesNotFailOpen (issue 23 item 4): every request a loose
// upstream routes to POST /orders is keyed. Before, a lower-case method, a
// trailing slash, another case and ";jsessionid" each bypassed the route: two
// requests with one key ran twice, and a keyless one was forwarded.
func TestRouteMatchingDoesNotFailOpen(t *testing.T) {
	t.Parallel()
	up := &looseRouter{}
	srv := httptest.NewServer(up)
	t.Cleanup(srv.Close)
	var logs bytes.Buffer
	var logMu sync.Mutex
	var unrouted atomic.Int64
	px := startProxy(t, srv.URL, proxy.Config{
		Routes:     []proxy.Route{{Pattern: "POST /orders"}},
		ErrorLog:   log.New(writerFunc(func(b []byte) (int, error) { logMu.Lock(); defer logMu.Unlock(); return logs.Write(b) }), "", 0),
		OnUnrouted: func(method, path string) { unrouted.Add(1) },
	})
	variants := [][2]string{{"post", "/orders"}, {"POST", "/orders/"}, {"POST", "/Orders"}, {"POST", "/orders;jsessionid=1"}, {"Post", "/ORDERS/;x=y"}, {"POST", "/orders/."}, {"POST", "//api/../orders//"}}
	for i, v := range variants {
		for range 2 {
			if a := send(t, v[0], px.url+v[1], `{}`, "Idempotency-Key", fmt.Sprint("loose-", i)); a.status != 201 {
				t.Errorf("%s %s: %d %s", v[0], v[1], a.status, a.body)
			}
		}
		wantProblem(t, send(t, v[0], px.url+v[1], `{}`), 400, idem.CodeKeyMissing)
	}
	if n := up.runs.Load(); n != int64(len(variants)) {
		t.Errorf("%d variants of POST /orders, each sent twice with one key: %d executions, want %d", len(variants), n, len(variants))
	}
	// A keyed request that matches no route: counted and logged once per path,
	// passed through (twice: it is not protected).
	for range 3 {
		send(t, "POST", px.url+"/other", `{}`, "Idempotency-Key", "other")
	}
	logMu.Lock()
	warnings := strings.Count(logs.String(), "matches no keyed route")
	logMu.Unlock()
	if unrouted.Load() != 3 || warnings != 1 || up.runs.Load() != int64(len(variants))+3 {
		t.Errorf("unrouted keyed requests: counted %d, warned %d times, %d runs; want 3, 1, %d", unrouted.Load(), warnings, up.runs.Load(), len(variants)+3)
	}
	// Strict mode keys them anyway.
	strict := startProxy(t, srv.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}, KeyUnrouted: true})
	before := up.runs.Load()
	for range 2 {
		if a := send(t, "POST", strict.url+"/other", `{}`, "Idempotency-Key", "other"); a.status != 201 {
			t.Errorf("strict: %d %s", a.status, a.body)
		}
	}
	if n := up.runs.Load() - before; n != 1 {
		t.Errorf("KeyUnrouted: two requests with one key ran %d times, want 1", n)
	}
	u, _ := url.Parse(srv.URL)
	for _, bad := range []string{"post /orders", "Post /orders"} {
		_, err := proxy.New(proxy.Config{Upstream: u, Store: px.store, Scope: proxy.NoScope(), Routes: []proxy.Route{{Pattern: bad}}})
		if err == nil || !strings.Contains(err.Error(), "POST /orders") {
			t.Errorf("pattern %q: %v, want an error that says to write POST /orders", bad, err)
		}
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }

func tlsConfig(pool *x509.CertPool, serverName string) *tls.Config {
	return &tls.Config{RootCAs: pool, ServerName: serverName}
}
