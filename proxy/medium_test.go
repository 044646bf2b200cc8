package proxy_test

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/pyorders"
	"github.com/idemkit/idem/proxy"
)

// TestQueryStringIsFingerprinted (issue 23 item 5): POST /charge?amount=1,
// then ?amount=1000 with the same key and body, is a reuse of the key for
// another request: 422, not the first answer replayed. The proxy uses the
// core's default fingerprint; this passes once that covers the query string
// (issue 25 item 6).
func TestQueryStringIsFingerprinted(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
		fmt.Fprintf(w, `{"charged":%q}`, r.URL.Query().Get("amount"))
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /charge"}}})
	if a := send(t, "POST", px.url+"/charge?amount=1", `{}`, "Idempotency-Key", "q"); a.status != 201 {
		t.Fatalf("first: %d %s", a.status, a.body)
	}
	wantProblem(t, send(t, "POST", px.url+"/charge?amount=1000", `{}`, "Idempotency-Key", "q"), 422, idem.CodeKeyReused)
	if runs.Load() != 1 {
		t.Errorf("upstream runs %d, want 1", runs.Load())
	}
}

// TestForwardedHeaders (issue 23 item 6): X-Forwarded-For is appended to;
// X-Forwarded-Proto, X-Forwarded-Host and Forwarded from a trusted hop reach
// the upstream (Rails force_ssl and Django SECURE_SSL_REDIRECT see https),
// from other peers they are the proxy's own; PreserveHost keeps Host; and an
// absolute Location naming the upstream is rewritten to the client's origin
// before it is stored.
func TestForwardedHeaders(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	loop := []netip.Prefix{netip.MustParsePrefix("127.0.0.0/8")}
	hdrs := []string{"X-Forwarded-For", "203.0.113.7", "X-Forwarded-Proto", "https", "X-Forwarded-Host", "shop.example", "Forwarded", "for=203.0.113.7;proto=https"}
	echo := func(px *fixture, key string) map[string]string {
		a := send(t, "POST", px.url+"/headers", `{}`, append([]string{"Idempotency-Key", key}, hdrs...)...)
		var doc struct{ Headers map[string]string }
		if err := json.Unmarshal(a.body, &doc); err != nil || a.status != 200 {
			t.Fatalf("/headers: %d %s", a.status, a.body)
		}
		return doc.Headers
	}
	routes := []proxy.Route{{Pattern: "POST /headers"}, {Pattern: "POST /loc"}}
	trusted := startProxy(t, app.URL, proxy.Config{Routes: routes, TrustForwarded: loop, PreserveHost: true})
	h := echo(trusted, "f1")
	u, _ := url.Parse(trusted.url)
	if h["x-forwarded-for"] != "203.0.113.7, 127.0.0.1" || h["x-forwarded-proto"] != "https" || h["x-forwarded-host"] != "shop.example" ||
		h["forwarded"] != "for=203.0.113.7;proto=https, for=127.0.0.1" || h["host"] != u.Host {
		t.Errorf("trusted hop: the upstream received %v", h)
	}
	untrusted := startProxy(t, app.URL, proxy.Config{Routes: routes})
	h = echo(untrusted, "f2")
	au, _ := url.Parse(app.URL)
	uu, _ := url.Parse(untrusted.url)
	if h["x-forwarded-for"] != "203.0.113.7, 127.0.0.1" || h["x-forwarded-proto"] != "http" || h["x-forwarded-host"] != uu.Host || h["forwarded"] != "" || h["host"] != au.Host {
		t.Errorf("untrusted peer: the upstream received %v", h)
	}
	// Location naming the upstream.
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Location", "http://"+r.Host+"/orders/1?x=1")
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	lp := startProxy(t, up.URL, proxy.Config{Routes: routes, TrustForwarded: loop})
	for i := range 2 {
		a := send(t, "POST", lp.url+"/loc", `{}`, append([]string{"Idempotency-Key", "loc"}, hdrs...)...)
		if loc := a.header.Get("Location"); a.status != 201 || loc != "https://shop.example/orders/1?x=1" {
			t.Errorf("attempt %d: %d Location %q, want https://shop.example/orders/1?x=1", i+1, a.status, loc)
		}
	}
}

// TestUnkeyedStreamsAreNotCutOff (issue 23 item 7): UpstreamTimeout decides
// the outcome of keyed requests; an unkeyed server-sent-events stream runs as
// long as the upstream streams. Before, it was cut after UpstreamTimeout.
func TestUnkeyedStreamsAreNotCutOff(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		rc := http.NewResponseController(w)
		for i := range 8 {
			fmt.Fprintf(w, "data: %d\n\n", i)
			_ = rc.Flush()
			if i == 3 {
				<-release // the stream outlives UpstreamTimeout
			}
		}
	}))
	t.Cleanup(up.Close)
	t.Cleanup(func() {
		select {
		case <-release:
		default:
			close(release)
		}
	})
	px := startProxy(t, up.URL, proxy.Config{UpstreamTimeout: 200 * time.Millisecond})
	resp, err := client.Get(px.url + "/events")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	r := bufio.NewReader(resp.Body)
	events := 0
	for {
		line, err := r.ReadString('\n')
		if strings.HasPrefix(line, "data: ") {
			events++
			if events == 4 {
				time.Sleep(600 * time.Millisecond) // three times UpstreamTimeout
				close(release)
			}
		}
		if err != nil {
			if err != io.EOF {
				t.Fatalf("after %d events: %v", events, err)
			}
			break
		}
	}
	if events != 8 {
		t.Errorf("%d of 8 events, want all", events)
	}
}

// TestReplayKeepsBrowserHeaders (issue 23 item 8): the replay carries CORS,
// Vary, Cache-Control and X-Content-Type-Options as the first answer did
// (a browser blocks a retried answer without Access-Control-Allow-Origin),
// never Set-Cookie.
func TestReplayKeepsBrowserHeaders(t *testing.T) {
	t.Parallel()
	want := map[string]string{
		"Access-Control-Allow-Origin": "https://app.example", "Access-Control-Allow-Credentials": "true",
		"Access-Control-Expose-Headers": "Location", "Vary": "Origin", "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
	}
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for k, v := range want {
			w.Header().Set(k, v)
		}
		w.Header().Set("Set-Cookie", "session=secret")
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{})
	send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "cors")
	a := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "cors")
	if a.header.Get(idem.ReplayedHeader) != "true" {
		t.Fatalf("not a replay: %d %v", a.status, a.header)
	}
	for k, v := range want {
		if got := a.header.Get(k); got != v {
			t.Errorf("replay: %s %q, want %q", k, got, v)
		}
	}
	if c := a.header.Get("Set-Cookie"); c != "" {
		t.Errorf("replay carries Set-Cookie %q", c)
	}
}

// TestScopeIsRequired (issue 23 item 9): a proxy without a scope is refused;
// NoScope says it explicitly.
func TestScopeIsRequired(t *testing.T) {
	t.Parallel()
	u, _ := url.Parse("http://127.0.0.1:1")
	if _, err := proxy.New(proxy.Config{Upstream: u, Store: sqliteStore(t)}); err == nil || !strings.Contains(err.Error(), "NoScope") {
		t.Errorf("no Scope: %v, want an error naming NoScope", err)
	}
	if _, err := proxy.New(proxy.Config{Upstream: u, Store: sqliteStore(t), Scope: proxy.NoScope()}); err != nil {
		t.Errorf("NoScope: %v", err)
	}
}

// TestExpectContinueIsNotForwarded (issue 23 item 16): the body of a keyed
// request is buffered already, so Expect: 100-continue is not sent upstream
// (where it cost a wait, or a 417 that was then stored).
func TestExpectContinueIsNotForwarded(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var got []string
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Header.Get("Expect"))
		mu.Unlock()
		if r.Header.Get("Expect") != "" {
			w.WriteHeader(http.StatusExpectationFailed)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{})
	u, _ := url.Parse(px.url)
	c, err := net.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"a":1}`
	fmt.Fprintf(c, "POST /orders HTTP/1.1\r\nHost: %s\r\nIdempotency-Key: exp\r\nExpect: 100-continue\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", u.Host, len(body), body)
	_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
	b, _ := io.ReadAll(c)
	if !strings.Contains(string(b), "HTTP/1.1 201") {
		t.Errorf("answer %q, want 201", b)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 1 || got[0] != "" {
		t.Errorf("the upstream received Expect %q", got)
	}
}

// TestHostScope (issue 23 item 18): HeaderScope("Host") keys by host name.
// Before, net/http had moved Host out of the header map and every keyed
// request got 401.
func TestHostScope(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	px := startProxy(t, app.URL, proxy.Config{Scope: proxy.HeaderScope("host"), Routes: []proxy.Route{{Pattern: "POST /orders"}}})
	for _, host := range []string{"a.example", "B.example", "a.example"} {
		req, _ := http.NewRequest("POST", px.url+"/orders", strings.NewReader(`{"cart_id":"h"}`))
		req.Host = host
		req.Header.Set("Idempotency-Key", "hk")
		if a := sendReq(t, req); a.status != 201 {
			t.Fatalf("Host %s: %d %s", host, a.status, a.body)
		}
	}
	if n := app.Executions(t); n != 2 {
		t.Errorf("executions %d, want 2 (one per host)", n)
	}
	if _, err := px.store.Get(context.Background(), "b.example", "hk", time.Now()); err != nil {
		t.Errorf("record under scope b.example: %v", err)
	}
}

// TestKeyedUpgradeIsRefused (issue 23 item 19): a keyed POST asking for
// Upgrade is 400 upgrade_refused before the upstream sees it. Before, it was
// forwarded: run by this upstream, and 502 upstream_failed with the outcome
// unknown from one that upgrades.
func TestKeyedUpgradeIsRefused(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1); w.WriteHeader(201) }))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{})
	wantProblem(t, send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "up", "Connection", "Upgrade", "Upgrade", "websocket"), 400, proxy.CodeUpgradeRefused)
	if runs.Load() != 0 {
		t.Errorf("the upstream ran %d times", runs.Load())
	}
	if rec, err := px.store.Get(context.Background(), "", "up", time.Now()); err == nil {
		t.Errorf("a record was left: %+v", rec)
	}
}

// TestJWTKeySetChecks (issue 23 item 14): a key set without kids is checked at
// start (one kid-less key verifies; two are refused with a message that says
// why), use: enc keys never verify, a key's alg binds, and tokens without exp
// or living longer than MaxTokenAge are refused.
func TestJWTKeySetChecks(t *testing.T) {
	t.Parallel()
	k, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	k2, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	sign := func(key *ecdsa.PrivateKey, kid string, claims map[string]any) string {
		opts := (&jose.SignerOptions{})
		if kid != "" {
			opts = opts.WithHeader("kid", kid)
		}
		s, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.ES256, Key: key}, opts)
		if err != nil {
			t.Fatal(err)
		}
		tok, err := jwt.Signed(s).Claims(claims).Serialize()
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	now := time.Now()
	good := map[string]any{"sub": "acme", "exp": now.Add(time.Hour).Unix(), "iat": now.Unix()}
	req := func(tok string) *http.Request {
		r, _ := http.NewRequest("POST", "http://x/orders", nil)
		r.Header.Set("Authorization", "Bearer "+tok)
		return r
	}
	// One key without kid: tokens verify.
	one, err := proxy.JWTScope(proxy.JWTConfig{Keys: &jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &k.PublicKey}}}})
	if err != nil {
		t.Fatal(err)
	}
	if s, err := one.Scope(req(sign(k, "", good))); err != nil || s != "acme" {
		t.Errorf("one kid-less key: %q %v", s, err)
	}
	// Two without kid: refused at start.
	if _, err := proxy.JWTScope(proxy.JWTConfig{Keys: &jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &k.PublicKey}, {Key: &k2.PublicKey}}}}); err == nil || !strings.Contains(err.Error(), "kid") {
		t.Errorf("two kid-less keys: %v, want an error about kid", err)
	}
	// use: enc and a mismatched alg.
	set := &jose.JSONWebKeySet{Keys: []jose.JSONWebKey{
		{Key: &k.PublicKey, KeyID: "enc", Use: "enc"},
		{Key: &k2.PublicKey, KeyID: "rs", Algorithm: "RS256", Use: "sig"},
		{Key: &k2.PublicKey, KeyID: "es", Algorithm: "ES256", Use: "sig"},
	}}
	sc, err := proxy.JWTScope(proxy.JWTConfig{Keys: set})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sc.Scope(req(sign(k, "enc", good))); err == nil {
		t.Error("a token verified with a use: enc key")
	}
	if _, err := sc.Scope(req(sign(k2, "rs", good))); err == nil || !strings.Contains(err.Error(), "RS256") {
		t.Errorf("an ES256 token with a key for RS256: %v, want refused naming RS256", err)
	}
	if s, err := sc.Scope(req(sign(k2, "es", good))); err != nil || s != "acme" {
		t.Errorf("the ES256 key: %q %v", s, err)
	}
	if _, err := proxy.JWTScope(proxy.JWTConfig{Keys: &jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &k.PublicKey, KeyID: "e", Use: "enc"}}}}); err == nil {
		t.Error("a key set of encryption keys only was accepted")
	}
	// exp required, lifetime bounded.
	noExp := map[string]any{"sub": "acme"}
	century := map[string]any{"sub": "acme", "exp": now.AddDate(100, 0, 0).Unix()}
	for name, c := range map[string]map[string]any{"no exp": noExp, "100 years": century} {
		if _, err := sc.Scope(req(sign(k2, "es", c))); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
	lax, err := proxy.JWTScope(proxy.JWTConfig{Keys: set, AllowNoExp: true, MaxTokenAge: -1})
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]map[string]any{"no exp": noExp, "100 years": century} {
		if _, err := lax.Scope(req(sign(k2, "es", c))); err != nil {
			t.Errorf("AllowNoExp, no MaxTokenAge: %s refused: %v", name, err)
		}
	}
}

// TestUnkeyedWebsocketOutlivesUpstreamTimeout (issue 23 item 7): an upgraded
// (websocket-like) connection is not cut when UpstreamTimeout passes. Before,
// the proxy closed it at UpstreamTimeout (every websocket died at 30 s).
func TestUnkeyedWebsocketOutlivesUpstreamTimeout(t *testing.T) {
	t.Parallel()
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Upgrade") != "echo" {
			w.WriteHeader(400)
			return
		}
		c, brw, err := http.NewResponseController(w).Hijack()
		if err != nil {
			return
		}
		defer c.Close()
		fmt.Fprint(brw, "HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
		_ = brw.Flush()
		_, _ = io.Copy(c, brw) // echo until the client closes
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{UpstreamTimeout: 200 * time.Millisecond})
	u, _ := url.Parse(px.url)
	c, err := net.Dial("tcp", u.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fmt.Fprintf(c, "GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: echo\r\n\r\n")
	_ = c.SetDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 101 {
		t.Fatalf("upgrade: %v %v", resp, err)
	}
	time.Sleep(700 * time.Millisecond) // past UpstreamTimeout
	if _, err := fmt.Fprint(c, "ping\n"); err != nil {
		t.Fatal(err)
	}
	line, err := br.ReadString('\n')
	if err != nil || line != "ping\n" {
		t.Fatalf("after UpstreamTimeout the upgraded connection answered %q, %v; want the echo", line, err)
	}
}
