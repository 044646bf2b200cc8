package proxy_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/checker"
	"github.com/idemkit/idem/internal/pyorders"
	"github.com/idemkit/idem/proxy"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// sqliteStore is a real SQLite store in a file of the test's own.
func sqliteStore(t testing.TB) idem.Store {
	t.Helper()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "keys.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

type fixture struct {
	store idem.Store
	url   string
}

func startProxy(t *testing.T, upstream string, cfg proxy.Config) *fixture {
	t.Helper()
	u, err := url.Parse(upstream)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Upstream = u
	if cfg.Store == nil {
		cfg.Store = sqliteStore(t)
	}
	if cfg.ErrorLog == nil {
		cfg.ErrorLog = log.New(io.Discard, "", 0)
	}
	if cfg.Scope == nil {
		cfg.Scope = proxy.NoScope()
	}
	p, err := proxy.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(srv.Close)
	return &fixture{store: cfg.Store, url: srv.URL}
}

var client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 60 * time.Second}

type answer struct {
	status int
	header http.Header
	body   []byte
}

func send(t *testing.T, method, url, body string, header ...string) answer {
	t.Helper()
	req, err := http.NewRequest(method, url, strings.NewReader(body))
	if err != nil {
		t.Error(err)
		return answer{}
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Add(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Errorf("%s %s: %v", method, url, err)
		return answer{}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Errorf("read the answer: %v", err)
	}
	return answer{resp.StatusCode, resp.Header, b}
}

func wantProblem(t *testing.T, a answer, status int, code string) {
	t.Helper()
	var p idem.Problem
	if a.status != status || json.Unmarshal(a.body, &p) != nil || p.Code != code || p.Detail == "" || !strings.HasSuffix(p.Type, "#"+code) {
		t.Fatalf("got %d %s, want %d problem %s", a.status, a.body, status, code)
	}
}

func TestCheckPassesThroughTheProxyAndFailsAgainstTheBareUpstream(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "", "--delay-ms", "150")
	px := startProxy(t, app.URL, proxy.Config{
		Routes: []proxy.Route{{Pattern: "POST /orders"}},
		Scope:  proxy.HeaderScope("X-Tenant-ID"),
	})
	run := func(base string) *checker.Report {
		rep, err := checker.Run(context.Background(), checker.Options{
			URL:           base + "/orders",
			Body:          `{"cart_id":"{{marker}}","total_cents":1900}`,
			Header:        http.Header{"X-Tenant-Id": {"tenant-a"}},
			TenantBHeader: http.Header{"X-Tenant-Id": {"tenant-b"}},
			CountURL:      base + "/orders?cart_id={{marker}}",
			Concurrency:   30,
			Rounds:        2,
			Timeout:       30 * time.Second,
		})
		if err != nil {
			t.Fatal(err)
		}
		return rep
	}
	var sb strings.Builder
	rep := run(px.url)
	_ = rep.WriteTable(&sb)
	if rep.Failed() || rep.Count(checker.Result("skip")) > 0 {
		t.Errorf("idem check through the proxy failed or skipped a case:\n%s", sb.String())
	}
	sb.Reset()
	bare := run(app.URL)
	_ = bare.WriteTable(&sb)
	if !bare.Failed() {
		t.Errorf("idem check against the bare upstream passed; it has no idempotency:\n%s", sb.String())
	}
	for _, c := range []string{"replay", "race"} {
		if bc := bare.Case(c); bc == nil || bc.Result != checker.Result("fail") {
			t.Errorf("bare upstream: case %s is not a failure:\n%s", c, sb.String())
		}
	}
}

func TestConcurrentSameKeyRunsTheUpstreamOnce(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "", "--delay-ms", "300")
	px := startProxy(t, app.URL, proxy.Config{})
	before := app.Executions(t)
	const n = 200
	answers := make([]answer, n)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i] = send(t, "POST", px.url+"/orders", `{"cart_id":"same","total_cents":5}`, "Idempotency-Key", "one-key", "Content-Type", "application/json")
		}()
	}
	close(start)
	wg.Wait()
	counts := map[int]int{}
	ids := map[string]bool{}
	for _, a := range answers {
		counts[a.status]++
		if a.status == 201 {
			ids[string(a.body)] = true
		}
	}
	if got := app.Executions(t) - before; got != 1 {
		t.Fatalf("%d requests with one key: the upstream executed %d times (answers %v), want 1", n, got, counts)
	}
	if counts[201]+counts[409] != n || counts[201] < 1 || len(ids) != 1 {
		t.Errorf("answers %v, %d distinct 201 bodies: want 201 (the execution or its replay) and 409 only, one body", counts, len(ids))
	}
	a := send(t, "POST", px.url+"/orders", `{"cart_id":"same","total_cents":5}`, "Idempotency-Key", "one-key", "Content-Type", "application/json")
	if a.status != 201 || a.header.Get(idem.ReplayedHeader) != "true" || a.header.Get("Location") == "" {
		t.Errorf("a later retry: %d %v, want the replayed 201 with its Location", a.status, a.header)
	}
}

func TestHopByHopHeaders(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	px := startProxy(t, app.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /headers", StoredHeaders: []string{"Content-Type", "X-End-To-End", "X-Hop-Secret"}}}})
	hdrs := []string{
		"Idempotency-Key", "hop", "Connection", "X-Client-Hop", "X-Client-Hop", "secret",
		"Keep-Alive", "timeout=9", "Proxy-Authorization", "Basic eDp5", "Te", "gzip", "X-Kept", "yes",
	}
	for i, want := range []string{"", "true"} {
		a := send(t, "POST", px.url+"/headers", `{}`, hdrs...)
		if a.status != 200 || a.header.Get(idem.ReplayedHeader) != want {
			t.Fatalf("attempt %d: %d %s, Idempotent-Replayed %q", i+1, a.status, a.body, a.header.Get(idem.ReplayedHeader))
		}
		var doc struct{ Headers map[string]string }
		if err := json.Unmarshal(a.body, &doc); err != nil {
			t.Fatal(err)
		}
		for _, h := range []string{"x-client-hop", "keep-alive", "proxy-authorization", "te", "transfer-encoding"} {
			if v, ok := doc.Headers[h]; ok {
				t.Errorf("the upstream received the hop-by-hop header %s: %q", h, v)
			}
		}
		if doc.Headers["x-kept"] != "yes" || doc.Headers["idempotency-key"] != "hop" || doc.Headers["x-forwarded-for"] == "" {
			t.Errorf("end-to-end headers lost, or no X-Forwarded-For: %v", doc.Headers)
		}
		for _, h := range []string{"X-Hop-Secret", "Keep-Alive"} {
			if v := a.header.Get(h); v != "" {
				t.Errorf("attempt %d: the client received the upstream's hop-by-hop header %s: %q", i+1, h, v)
			}
		}
		if a.header.Get("X-End-To-End") != "kept" {
			t.Errorf("attempt %d: X-End-To-End lost: %v", i+1, a.header)
		}
	}
}

func TestUnreachableUpstreamReleasesTheKey(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close() // nothing listens there now
	px := startProxy(t, "http://"+addr, proxy.Config{})
	for range 2 { // the second attempt is not a 409 or a replay: the key was released
		wantProblem(t, send(t, "POST", px.url+"/orders", `{"cart_id":"x"}`, "Idempotency-Key", "down"), 502, proxy.CodeUpstreamUnreachable)
		if _, err := px.store.Get(context.Background(), "", "down", time.Now()); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("record after an unreachable upstream: %v, want none (released)", err)
		}
	}
	// Unkeyed requests get the same problem, without a key to release.
	wantProblem(t, send(t, "GET", px.url+"/orders", ""), 502, proxy.CodeUpstreamUnreachable)
}

func TestUpstreamTimeoutIsAClearProblemAndTheOutcomeUnknown(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	px := startProxy(t, app.URL, proxy.Config{UpstreamTimeout: 300 * time.Millisecond, Routes: []proxy.Route{{Pattern: "POST /orders", Lease: time.Minute}}})
	body := `{"cart_id":"slow","sleep_ms":3000}`
	wantProblem(t, send(t, "POST", px.url+"/orders", body, "Idempotency-Key", "slow"), 504, proxy.CodeUpstreamTimeout)
	rec, err := px.store.Get(context.Background(), "", "slow", time.Now())
	if err != nil || rec.State != idem.StateInFlight {
		t.Fatalf("record after the timeout: %+v %v, want in flight (outcome unknown)", rec, err)
	}
	wantProblem(t, send(t, "POST", px.url+"/orders", body, "Idempotency-Key", "slow"), 409, idem.CodeKeyInUse)
	if n := app.Executions(t); n != 1 {
		t.Errorf("upstream executions: %d, want 1", n)
	}
}

func TestRoutesAndPassThrough(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	px := startProxy(t, app.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}, {Pattern: "POST /optional/", KeyOptional: true}}})
	wantProblem(t, send(t, "POST", px.url+"/orders", `{"cart_id":"r"}`), 400, idem.CodeKeyMissing)
	if a := send(t, "GET", px.url+"/executions", ""); a.status != 200 {
		t.Errorf("GET passes through: %d", a.status)
	}
	if a := send(t, "POST", px.url+"/headers", `{}`); a.status != 200 {
		t.Errorf("POST on an unrouted path passes through without a key: %d %s", a.status, a.body)
	}
	if a := send(t, "POST", px.url+"/optional/x", `{}`); a.status != 404 {
		t.Errorf("key-optional route without a key: %d, want the upstream's 404", a.status)
	}
	u, _ := url.Parse(app.URL)
	for _, bad := range [][]string{{"POST orders"}, {"POST /{"}, {"POST /a/{x}", "POST /a/{y}"}, {"POST /a", "POST /a"}} {
		var routes []proxy.Route
		for _, p := range bad {
			routes = append(routes, proxy.Route{Pattern: p})
		}
		if _, err := proxy.New(proxy.Config{Upstream: u, Store: px.store, Routes: routes}); err == nil {
			t.Errorf("patterns %q accepted", bad)
		}
	}
}

func TestBodilessKeyedRequestIsSentOnce(t *testing.T) {
	t.Parallel()
	// The upstream reads the request, then drops the connection without an
	// answer: net/http's Transport would re-send a bodiless request with an
	// Idempotency-Key on a new connection. The proxy must not.
	var mu sync.Mutex
	got := 0
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/warm" {
			return
		}
		mu.Lock()
		got++
		mu.Unlock()
		c, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = c.Close()
		}
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /pay"}}})
	send(t, "GET", px.url+"/warm", "") // leaves an idle connection to reuse
	wantProblem(t, send(t, "POST", px.url+"/pay", "", "Idempotency-Key", "empty"), 502, proxy.CodeUpstreamFailed)
	mu.Lock()
	defer mu.Unlock()
	if got != 1 {
		t.Errorf("the upstream received the request %d times, want 1", got)
	}
}

// jwtIssuer signs tokens with an ES256 key whose public half is the JWKS.
type jwtIssuer struct {
	signer jose.Signer
	jwks   *jose.JSONWebKeySet
}

func newIssuer(t *testing.T, kid string) *jwtIssuer {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	s, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.ES256, Key: jose.JSONWebKey{Key: k, KeyID: kid}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return &jwtIssuer{signer: s, jwks: &jose.JSONWebKeySet{Keys: []jose.JSONWebKey{{Key: &k.PublicKey, KeyID: kid, Algorithm: "ES256", Use: "sig"}}}}
}

func (i *jwtIssuer) token(t *testing.T, claims map[string]any) string {
	t.Helper()
	tok, err := jwt.Signed(i.signer).Claims(claims).Serialize()
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

func TestJWTScope(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	iss := newIssuer(t, "k1")
	scope, err := proxy.JWTScope(proxy.JWTConfig{Keys: iss.jwks, Claim: "tenant", Issuer: "https://issuer.test", Audience: "orders"})
	if err != nil {
		t.Fatal(err)
	}
	px := startProxy(t, app.URL, proxy.Config{Scope: scope, Routes: []proxy.Route{{Pattern: "POST /orders"}}})
	now := time.Now().Unix()
	claims := func(tenant string) map[string]any {
		return map[string]any{"tenant": tenant, "iss": "https://issuer.test", "aud": "orders", "exp": now + 300, "sub": "u1"}
	}
	post := func(tok string) answer {
		return send(t, "POST", px.url+"/orders", `{"cart_id":"jwt"}`, "Idempotency-Key", "jk", "Authorization", "Bearer "+tok)
	}
	if a := post(iss.token(t, claims("acme"))); a.status != 201 {
		t.Fatalf("valid token: %d %s", a.status, a.body)
	}
	if rec, err := px.store.Get(context.Background(), "acme", "jk", time.Now()); err != nil || rec.State != idem.StateComplete {
		t.Fatalf("record under scope acme: %v %v", rec, err)
	}
	// Same key, other tenant: its own execution, not acme's answer.
	if a := post(iss.token(t, claims("globex"))); a.status != 201 || a.header.Get(idem.ReplayedHeader) != "" {
		t.Errorf("other tenant: %d replayed=%q", a.status, a.header.Get(idem.ReplayedHeader))
	}
	forger := newIssuer(t, "k1") // same kid, another key: an unverified claim
	expired := claims("acme")
	expired["exp"] = now - 3600
	wrongAud := claims("acme")
	wrongAud["aud"] = "billing"
	noClaim := claims("")
	none := "eyJhbGciOiJub25lIn0." + strings.TrimRight(strings.Split(iss.token(t, claims("acme")), ".")[1], "=") + "."
	for name, tok := range map[string]string{
		"forged": forger.token(t, claims("acme")), "expired": iss.token(t, expired), "audience": iss.token(t, wrongAud),
		"no claim": iss.token(t, noClaim), "alg none": none, "garbage": "x.y.z",
	} {
		a := post(tok)
		if a.status != 401 {
			t.Errorf("%s token: %d %s, want 401", name, a.status, a.body)
			continue
		}
		wantProblem(t, a, 401, proxy.CodeScopeInvalid)
	}
	wantProblem(t, send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "jk"), 401, proxy.CodeScopeMissing)
	if n := app.Executions(t); n != 2 {
		t.Errorf("upstream executions: %d, want 2 (acme and globex)", n)
	}
}

func TestHeaderAndBearerScopes(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	hp := startProxy(t, app.URL, proxy.Config{Scope: proxy.HeaderScope("X-Tenant-ID")})
	wantProblem(t, send(t, "POST", hp.url+"/orders", `{"cart_id":"h"}`, "Idempotency-Key", "h"), 401, proxy.CodeScopeMissing)
	if a := send(t, "POST", hp.url+"/orders", `{"cart_id":"h"}`, "Idempotency-Key", "h", "X-Tenant-ID", "t1"); a.status != 201 {
		t.Fatalf("%d %s", a.status, a.body)
	}
	if _, err := hp.store.Get(context.Background(), "t1", "h", time.Now()); err != nil {
		t.Errorf("record under scope t1: %v", err)
	}
	bp := startProxy(t, app.URL, proxy.Config{Scope: proxy.BearerScope()})
	if a := send(t, "POST", bp.url+"/orders", `{"cart_id":"b"}`, "Idempotency-Key", "b", "Authorization", "Bearer s3cret"); a.status != 201 {
		t.Fatalf("%d %s", a.status, a.body)
	}
	if _, err := bp.store.Get(context.Background(), proxy.BearerScopeOf("s3cret"), "b", time.Now()); err != nil {
		t.Errorf("record under the token's digest: %v", err)
	}
	if _, err := bp.store.Get(context.Background(), "s3cret", "b", time.Now()); err == nil {
		t.Error("the bearer token itself was stored as the scope")
	}
}

// TestScopeHeaderSentTwice: two lines of the scope header (or of
// Authorization) are 401 scope_invalid, never the scope of the first line: a
// gateway that appends its header after the client's would otherwise let the
// client read another tenant's stored answers. Before, the first line was the
// scope, and tenant t2's request with t1's line first got t1's replay.
func TestScopeHeaderSentTwice(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	hp := startProxy(t, app.URL, proxy.Config{Scope: proxy.HeaderScope("X-Tenant-ID")})
	body := `{"cart_id":"twice"}`
	if a := send(t, "POST", hp.url+"/orders", body, "Idempotency-Key", "k2", "X-Tenant-ID", "t1"); a.status != 201 {
		t.Fatalf("t1: %d %s", a.status, a.body)
	}
	wantProblem(t, send(t, "POST", hp.url+"/orders", body, "Idempotency-Key", "k2", "X-Tenant-ID", "t1", "X-Tenant-ID", "t2"), 401, proxy.CodeScopeInvalid)
	bp := startProxy(t, app.URL, proxy.Config{Scope: proxy.BearerScope()})
	if a := send(t, "POST", bp.url+"/orders", body, "Idempotency-Key", "k3", "Authorization", "Bearer a"); a.status != 201 {
		t.Fatalf("bearer a: %d %s", a.status, a.body)
	}
	wantProblem(t, send(t, "POST", bp.url+"/orders", body, "Idempotency-Key", "k3", "Authorization", "Bearer a", "Authorization", "Bearer b"), 401, proxy.CodeScopeInvalid)
	if n := app.Executions(t); n != 2 {
		t.Errorf("upstream executions: %d, want 2", n)
	}
}

func ExampleNew() {
	up, _ := url.Parse("http://127.0.0.1:3000")
	p, err := proxy.New(proxy.Config{
		Upstream: up,
		Store:    mustStore(),
		Routes:   []proxy.Route{{Pattern: "POST /orders"}, {Pattern: "PATCH /orders/{id}", TTL: time.Hour}},
		Scope:    proxy.HeaderScope("X-Tenant-ID"),
	})
	fmt.Println(p != nil, err)
	// Output: true <nil>
}

// An upstream 5xx is kept and replayed like any answer by default (the
// upstream may have acted before it failed); with Release5xx it is passed on,
// the key released, and the retry runs the operation again.
func TestUpstream5xxKeptUnlessReleased(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if calls.Add(1)%2 == 1 { // every other call fails, as an overloaded upstream does
			http.Error(w, "overloaded", http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
		fmt.Fprint(w, `{"id":1}`)
	}))
	t.Cleanup(up.Close)
	for _, release := range []bool{false, true} {
		calls.Store(0)
		px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders", Release5xx: release}}})
		first := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "k")
		retry := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "k")
		if first.status != http.StatusServiceUnavailable {
			t.Fatalf("Release5xx %v: first answer %d %s, want the upstream's 503", release, first.status, first.body)
		}
		switch {
		case !release && (retry.status != http.StatusServiceUnavailable || retry.header.Get(idem.ReplayedHeader) != "true" || calls.Load() != 1):
			t.Fatalf("default: retry %d replayed=%q after %d upstream calls, want the 503 replayed after 1", retry.status, retry.header.Get(idem.ReplayedHeader), calls.Load())
		case release && (retry.status != http.StatusCreated || retry.header.Get(idem.ReplayedHeader) != "" || calls.Load() != 2):
			t.Fatalf("Release5xx: retry %d replayed=%q after %d upstream calls, want a fresh 201 after 2", retry.status, retry.header.Get(idem.ReplayedHeader), calls.Load())
		}
		if again := send(t, "POST", px.url+"/orders", `{}`, "Idempotency-Key", "k"); again.status != retry.status || again.header.Get(idem.ReplayedHeader) != "true" {
			t.Fatalf("Release5xx %v: third request %d replayed=%q, want the second answer replayed", release, again.status, again.header.Get(idem.ReplayedHeader))
		}
	}
}
