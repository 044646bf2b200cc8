package proxy

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/http/httputil"
	"net/netip"
	"net/url"
	"path"
	"slices"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

// ProblemTypeBase prefixes the type URI of the proxy's own problems; the
// fragment is the problem's code, documented in docs/proxy.md.
const ProblemTypeBase = "https://github.com/idemkit/idem/blob/main/docs/proxy.md#"

// Problem codes of the proxy's own answers (application/problem+json, with the
// code in the "code" member, as idem's). They are API.
const (
	// CodeUpstreamUnreachable (502): the request did not reach the upstream
	// (the connection, or its TLS handshake, failed, or the connection broke
	// before a byte of the request was written), so it cannot have run there;
	// the key was released and a retry runs afresh.
	CodeUpstreamUnreachable = "upstream_unreachable"
	// CodeUpstreamFailed (502): the upstream failed after (part of) the
	// request was written (it closed the connection or broke off its answer),
	// so whether the operation took effect is unknown: most frameworks run a
	// handler once its headers are in. The key stays in flight until its
	// lease lapses.
	CodeUpstreamFailed = "upstream_failed"
	// CodeUpstreamTimeout (504): the upstream did not answer within
	// Config.UpstreamTimeout; the outcome is unknown, as for upstream_failed.
	CodeUpstreamTimeout = "upstream_timeout"
	// CodeScopeMissing (401): the request carries no scope (tenant header,
	// bearer token or JWT) and the proxy is configured to key by one.
	CodeScopeMissing = "scope_missing"
	// CodeScopeInvalid (401): the request's JWT did not verify, or lacks the
	// scope claim.
	CodeScopeInvalid = "scope_invalid"
	// CodeUpgradeRefused (400): a keyed request asked to upgrade the connection
	// (Upgrade: websocket, h2c, …); an upgraded connection has no answer to
	// keep, so a keyed route refuses it before anything reaches the upstream.
	CodeUpgradeRefused = "upgrade_refused"
)

// DefaultUpstreamTimeout bounds a keyed request's upstream call when
// Config.UpstreamTimeout is zero.
const DefaultUpstreamTimeout = 30 * time.Second

// DefaultUpstreamIdleTimeout is how long an idle connection to the upstream is
// kept for unkeyed requests when Config.UpstreamIdleTimeout is zero: below the
// keep-alive timeouts of common upstreams (gunicorn 2 s, Node.js and uvicorn
// 5 s), so that the proxy, not the upstream, closes an idle connection.
const DefaultUpstreamIdleTimeout = time.Second

// DefaultReleaseStatus are the upstream answers a route passes on without
// keeping, releasing the key, unless Route.ReleaseStatus says otherwise: they
// mean "not now" (401 and 403: not authenticated or not allowed, which a new
// token may change; 408 request timeout; 425 too early; 429 too many
// requests), are never bound to a key, and stay retryable.
var DefaultReleaseStatus = []int{
	http.StatusUnauthorized, http.StatusForbidden, http.StatusRequestTimeout,
	http.StatusTooEarly, http.StatusTooManyRequests,
}

// DefaultStoredHeaders are the upstream's response headers a route keeps for
// replay unless Route.StoredHeaders says otherwise: idem's defaults, what a
// browser needs to accept a replayed answer (CORS, Vary, caching,
// X-Content-Type-Options) and what belongs to a "not now" answer (Retry-After,
// WWW-Authenticate). Never Set-Cookie.
var DefaultStoredHeaders = append(slices.Clone(idem.DefaultStoredHeaders),
	"Retry-After", "WWW-Authenticate", "Cache-Control", "Expires", "Vary",
	"Access-Control-Allow-Origin", "Access-Control-Allow-Credentials", "Access-Control-Expose-Headers",
	"X-Content-Type-Options",
)

// Route says which requests are keyed and how their records are kept. The zero
// values of its limits are idem's defaults (idem.Config).
//
// A route protects every request the upstream's router would likely send to
// the same handler: its pattern is matched without regard to the case of the
// method or the path, with or without a trailing slash, with the path
// parameters of a segment (";jsessionid=…") ignored, and, for a path with
// percent-escapes, both decoded and as escaped ("/orders/a%2Fb" is
// "PATCH /orders/{id}").
type Route struct {
	// Pattern is a net/http.ServeMux pattern: "POST /orders",
	// "PATCH /orders/{id}", "/payments/" (a subtree). Without a method, POST and
	// PATCH are keyed; with one (upper-case, as HTTP spells it), that method is.
	Pattern string
	// KeyOptional lets keyed requests without a key through to the upstream,
	// unprotected. Defaults to false: they get 400 idempotency_key_missing.
	KeyOptional bool
	// TTL is how long an outcome is kept and replayed (idem.Config.TTL).
	TTL time.Duration
	// Lease is the in-flight lease, renewed while the upstream works
	// (idem.Config.Lease).
	Lease time.Duration
	// InFlightWait is how long a retry that finds its key still at the
	// upstream waits for the outcome and gets the replay, instead of 409
	// idempotency_key_in_use (idem.Config.InFlightWait). Defaults to 0: 409
	// at once.
	InFlightWait time.Duration
	// StoredHeaders are the upstream's response headers kept for replay
	// (idem.Config.StoredHeaders); nil for DefaultStoredHeaders.
	StoredHeaders []string
	// MaxRequestBody is the largest request body buffered and fingerprinted;
	// larger gets 413 (idem.Config.MaxRequestBody).
	MaxRequestBody int64
	// MaxStoredBody is the largest response body kept for replay
	// (idem.Config.MaxStoredBody).
	MaxStoredBody int
	// ReleaseStatus are the upstream statuses passed on without being kept: the
	// key is released, so that a retry runs the operation again. nil means
	// DefaultReleaseStatus; an empty, non-nil list keeps every answer. Each must
	// be a 4xx or 5xx status.
	ReleaseStatus []int
	// Release5xx adds every 5xx status to ReleaseStatus. Set it only when the
	// upstream's 5xx answers never leave effects behind. By default a 5xx is
	// kept and replayed for TTL: the upstream may have acted before it failed.
	Release5xx bool
}

// DefaultRoutes is what Config.Routes means when empty: POST and PATCH keyed on
// every path.
var DefaultRoutes = []Route{{Pattern: "/"}}

// Config configures a Proxy. Upstream, Store and Scope are required.
type Config struct {
	// Upstream is the base URL requests are forwarded to, such as
	// http://127.0.0.1:3000; its path, if any, prefixes the request's.
	Upstream *url.URL
	// Store keeps the key records. Share one store (a SQL database or Redis)
	// between proxy instances in front of one upstream. The proxy never uses a
	// store's transactions: it cannot share the upstream's.
	Store idem.Store
	// Routes are the keyed routes; other requests pass through unprotected.
	// Defaults to DefaultRoutes.
	Routes []Route
	// Scope gives the tenant of a keyed request (HeaderScope, BearerScope,
	// JWTScope). Required: NoScope() says explicitly that every caller shares
	// one key space, and that a replay then skips the upstream's
	// authentication.
	Scope Scope
	// RepeatSafe says that running an operation twice is harmless at the
	// upstream. Only then does a retry that finds a lapsed lease (the upstream
	// or a proxy died mid-request) run the operation again; otherwise it gets
	// 503 idempotency_outcome_unknown until an operator resolves the key with
	// `idem resolve`. Defaults to false.
	RepeatSafe bool
	// UpstreamTimeout bounds each keyed request's upstream call, from sending
	// the request to the end of the answer: it decides the request's outcome.
	// Unkeyed requests (streams, websockets) are not bounded by the proxy.
	// Defaults to DefaultUpstreamTimeout.
	UpstreamTimeout time.Duration
	// UpstreamIdleTimeout is how long an idle upstream connection is kept for
	// unkeyed requests; keep it below the upstream's keep-alive timeout.
	// Keyed requests never reuse a connection (see docs/proxy.md). Defaults to
	// DefaultUpstreamIdleTimeout.
	UpstreamIdleTimeout time.Duration
	// UpstreamTLS configures TLS to an https upstream: RootCAs (a private CA),
	// ServerName. Defaults to the system's roots and the upstream's host.
	UpstreamTLS *tls.Config
	// UpstreamProxy is a forward proxy to reach the upstream through. Defaults
	// to none: HTTP_PROXY and the like are ignored, so that a forward proxy's
	// answer is never stored as the upstream's.
	UpstreamProxy *url.URL
	// Transport sends requests upstream, keyed and unkeyed, replacing the
	// proxy's own transports (and UpstreamIdleTimeout, UpstreamTLS,
	// UpstreamProxy). With a transport of your own the proxy cannot tell a
	// request that broke off while it was written from one that reached the
	// upstream. Defaults to nil.
	Transport http.RoundTripper
	// TrustForwarded are the networks of the hops in front of the proxy (a
	// gateway terminating TLS) whose X-Forwarded-Proto, X-Forwarded-Host and
	// Forwarded headers are passed on; from other peers they are replaced
	// (X-Forwarded-Proto, -Host) or removed (Forwarded, and X-Forwarded-Ssl,
	// -Scheme, -Protocol, -Port, -Prefix, -Server, X-Url-Scheme,
	// Front-End-Https and X-Real-IP, which upstreams read the same way).
	// X-Forwarded-For is always appended to, as nginx and Envoy do.
	TrustForwarded []netip.Prefix
	// PreserveHost sends the client's Host upstream instead of the upstream's
	// host.
	PreserveHost bool
	// KeyUnrouted keys a request that carries an Idempotency-Key but matches no
	// keyed route (strict mode), with idem's defaults, instead of passing it
	// through unprotected. Either way such requests are reported to
	// OnUnrouted and logged, once per method and path.
	KeyUnrouted bool
	// OnUnrouted, when set, is called for every request that carries an
	// Idempotency-Key but matches no keyed route (a metric, say).
	OnUnrouted func(method, path string)
	// Observer is told about every decision of the middleware.
	Observer idem.Observer
	// ErrorLog receives the upstream errors and warnings. Defaults to the log
	// package's standard logger.
	ErrorLog *log.Logger
}

// NoScope is the Scope of a proxy whose callers all share one key space: a
// replay then goes to whoever sends the key, whatever their credentials. Use
// it only when one client (or a gateway that adds its own keys) calls the
// proxy.
func NoScope() Scope { return noScope{} }

type noScope struct{}

func (noScope) Scope(*http.Request) (string, error) { return "", nil }

// Proxy is an http.Handler that forwards to the upstream, keyed routes through
// the idem middleware.
type Proxy struct {
	mux       *http.ServeMux
	unrouted  *route // strict mode: keyed requests that match no route
	bare      http.Handler
	scope     Scope
	keyHeader string
	log       *log.Logger
	onUnroute func(method, path string)
	warnMu    sync.Mutex
	warned    map[string]bool
	up        *upstream
	timeout   time.Duration
}

// maxWarnedPaths bounds the paths remembered for the once-per-path warning.
const maxWarnedPaths = 1024

type route struct {
	pattern   string
	protected http.Handler
	keyed     map[string]bool
}

// ServeHTTP is never called: the mux only matches.
func (*route) ServeHTTP(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusNotFound) }

// plainStore hides a store's transactions (TxStore, SingleTxStore): the proxy
// has no business writes of its own to commit with the outcome, and a
// transaction held open across an upstream call would only hold a connection.
type plainStore struct{ idem.Store }

// New builds a Proxy. Errors say what to change.
func New(cfg Config) (*Proxy, error) {
	if cfg.Upstream == nil || cfg.Upstream.Scheme == "" || cfg.Upstream.Host == "" {
		return nil, errors.New("proxy: Upstream must be an absolute URL such as http://127.0.0.1:3000")
	}
	if cfg.Upstream.Scheme != "http" && cfg.Upstream.Scheme != "https" {
		return nil, fmt.Errorf("proxy: Upstream scheme %q: use http or https", cfg.Upstream.Scheme)
	}
	if cfg.Store == nil {
		return nil, errors.New("proxy: Store is nil; pass an idem store, for example one opened from a --db URL")
	}
	if cfg.Scope == nil {
		return nil, errors.New("proxy: Scope is nil; give the tenant of a request (HeaderScope, BearerScope, JWTScope), or NoScope() if every caller may share one key space")
	}
	if cfg.UpstreamTimeout == 0 {
		cfg.UpstreamTimeout = DefaultUpstreamTimeout
	} else if cfg.UpstreamTimeout < 0 {
		return nil, fmt.Errorf("proxy: UpstreamTimeout %v: use a positive duration", cfg.UpstreamTimeout)
	}
	if cfg.UpstreamIdleTimeout == 0 {
		cfg.UpstreamIdleTimeout = DefaultUpstreamIdleTimeout
	} else if cfg.UpstreamIdleTimeout < 0 {
		return nil, fmt.Errorf("proxy: UpstreamIdleTimeout %v: use a positive duration", cfg.UpstreamIdleTimeout)
	}
	if cfg.ErrorLog == nil {
		cfg.ErrorLog = log.Default()
	}
	if len(cfg.Routes) == 0 {
		cfg.Routes = DefaultRoutes
	}
	pooled, fresh := cfg.Transport, cfg.Transport
	if cfg.Transport == nil {
		pooled, fresh = transports(cfg)
	}
	p := &Proxy{
		mux: http.NewServeMux(), scope: cfg.Scope, keyHeader: idem.DefaultHeaderName, log: cfg.ErrorLog,
		onUnroute: cfg.OnUnrouted, warned: map[string]bool{}, timeout: cfg.UpstreamTimeout,
	}
	fw := &forwarding{upstream: cfg.Upstream, trusted: cfg.TrustForwarded, preserveHost: cfg.PreserveHost, customTransport: cfg.Transport != nil}
	newRP := func(t http.RoundTripper) *httputil.ReverseProxy {
		return &httputil.ReverseProxy{
			Rewrite:        fw.rewrite,
			Transport:      t,
			ModifyResponse: fw.modifyResponse,
			ErrorLog:       cfg.ErrorLog,
			FlushInterval:  -1,
		}
	}
	up := &upstream{rp: newRP(pooled), keyedRP: newRP(fresh), timeout: cfg.UpstreamTimeout, log: cfg.ErrorLog, inflight: map[*call]struct{}{}}
	up.rp.ErrorHandler, up.keyedRP.ErrorHandler = up.failed, up.failed
	p.up = up
	p.bare = up
	lapsed := idem.LapsedRefuse
	if cfg.RepeatSafe {
		lapsed = idem.LapsedTakeOver
	}
	store := plainStore{cfg.Store}
	build := func(rt Route, methods []string) (*route, error) {
		keep, err := keepFunc(rt)
		if err != nil {
			return nil, err
		}
		stored := rt.StoredHeaders
		if stored == nil {
			stored = DefaultStoredHeaders
		}
		mw, err := idem.New(store, &idem.Config{
			KeepFunc: keep,
			// Only keyed requests reach the middleware (see match): those of
			// the route's methods, and POSTs that override their method to one.
			Methods:        append(slices.Clone(methods), http.MethodPost),
			KeyOptional:    rt.KeyOptional,
			Lease:          rt.Lease,
			TTL:            rt.TTL,
			InFlightWait:   rt.InFlightWait,
			MaxRequestBody: rt.MaxRequestBody,
			MaxStoredBody:  rt.MaxStoredBody,
			StoredHeaders:  stored,
			Flow:           idem.FlowClaimComplete,
			Observer:       cfg.Observer,
			LapsedLease:    lapsed,
			// The upstream call ends first, with a clear answer (upstream_timeout).
			HandlerTimeout: cfg.UpstreamTimeout + time.Second,
		})
		if err != nil {
			return nil, err
		}
		buffered := int64(rt.MaxStoredBody)
		if buffered == 0 {
			buffered = idem.DefaultMaxStoredBody
		}
		rup := &upstream{rp: up.rp, keyedRP: up.keyedRP, timeout: up.timeout, log: up.log, buffered: buffered, tracker: up}
		r := &route{pattern: rt.Pattern, protected: mw(rup), keyed: map[string]bool{}}
		for _, m := range methods {
			r.keyed[strings.ToUpper(m)] = true
		}
		return r, nil
	}
	seen := map[string]int{}
	for i, rt := range cfg.Routes {
		pattern, methods, err := parsePattern(rt.Pattern)
		if err != nil {
			return nil, fmt.Errorf("proxy: route %d: %w", i+1, err)
		}
		if j, dup := seen[pattern]; dup {
			return nil, fmt.Errorf("proxy: route %d: pattern %q is route %d's too (paths match regardless of case)", i+1, rt.Pattern, j)
		}
		seen[pattern] = i + 1
		r, err := build(rt, methods)
		if err != nil {
			return nil, fmt.Errorf("proxy: route %d (%q): %w", i+1, rt.Pattern, err)
		}
		if err := register(p.mux, pattern, r); err != nil {
			return nil, fmt.Errorf("proxy: route %d: %w", i+1, err)
		}
	}
	if cfg.KeyUnrouted {
		r, err := build(Route{}, unroutedMethods)
		if err != nil {
			return nil, fmt.Errorf("proxy: KeyUnrouted: %w", err)
		}
		p.unrouted = r
	}
	return p, nil
}

// unroutedMethods are the methods KeyUnrouted keys: the ones that change
// something.
var unroutedMethods = []string{http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete}

// transports returns the proxy's own transports: pooled, for unkeyed requests,
// and fresh, for keyed ones, which opens a new connection for every request.
// A keyed request never goes out on a connection that sat idle: the upstream
// may be closing it (its keep-alive timeout, a rolling restart) as the
// request is written, and the request would then fail in a way that cannot be
// told from an upstream that died running it.
func transports(cfg Config) (pooled, fresh http.RoundTripper) {
	t := http.DefaultTransport.(*http.Transport).Clone()
	t.Proxy = nil
	if cfg.UpstreamProxy != nil {
		t.Proxy = http.ProxyURL(cfg.UpstreamProxy)
	}
	t.MaxIdleConns = 256
	t.MaxIdleConnsPerHost = 256
	t.IdleConnTimeout = cfg.UpstreamIdleTimeout
	t.ExpectContinueTimeout = time.Second
	if cfg.UpstreamTLS != nil {
		t.TLSClientConfig = cfg.UpstreamTLS.Clone()
	} else {
		t.TLSClientConfig = &tls.Config{}
	}
	if t.TLSClientConfig.ClientSessionCache == nil {
		// Fresh connections for keyed requests resume TLS sessions.
		t.TLSClientConfig.ClientSessionCache = tls.NewLRUClientSessionCache(256)
	}
	dial := (&net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &countConn{Conn: c}, nil
	}
	k := t.Clone()
	// No idle connection is kept (a negative MaxIdleConnsPerHost), yet the
	// request does not say "Connection: close" (DisableKeepAlives would): an
	// upstream that then stops reading the request, and closes, could reset
	// the connection under its own answer.
	k.MaxIdleConnsPerHost = -1
	// And HTTP/1.1 only: HTTP/2 would multiplex keyed requests over one
	// shared connection, kept and reused whatever MaxIdleConnsPerHost says.
	k.ForceAttemptHTTP2 = false
	k.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	k.TLSClientConfig.NextProtos = nil
	return t, k
}

// countConn counts the writes to an upstream connection that may have put
// bytes on the wire, so that a failed keyed request that wrote nothing can be
// told from one that may have reached the upstream. A write counts from before
// it starts (the upstream can answer before it returns) unless it wrote
// nothing.
type countConn struct {
	net.Conn
	writes atomic.Int64
}

func (c *countConn) Write(b []byte) (int, error) {
	if len(b) == 0 {
		return c.Conn.Write(b)
	}
	c.writes.Add(1)
	n, err := c.Conn.Write(b)
	if n == 0 {
		c.writes.Add(-1)
	}
	return n, err
}

// parsePattern checks a route pattern and returns it as the mux holds it (the
// path in lower case) with the methods it keys.
func parsePattern(pattern string) (string, []string, error) {
	p := strings.TrimSpace(pattern)
	methods := idem.DefaultMethods
	method, path := "", p
	if m, rest, ok := strings.Cut(p, " "); ok && !strings.HasPrefix(m, "/") {
		method, path = m, strings.TrimLeft(rest, " \t")
		if up := strings.ToUpper(method); up != method {
			return "", nil, fmt.Errorf("pattern %q: method %q is not upper-case; write %q (requests match it whatever the case they send)", pattern, method, up+" "+path)
		}
		methods = []string{method}
	}
	if strings.HasPrefix(path, "/") {
		path = strings.ToLower(path)
	} else if i := strings.IndexByte(path, '/'); i > 0 {
		return "", nil, fmt.Errorf("pattern %q: host patterns are not supported; write a path such as \"POST /orders\"", pattern)
	}
	if method != "" {
		return method + " " + path, methods, nil
	}
	return path, methods, nil
}

// register adds pattern to mux, turning ServeMux's panics (an invalid pattern,
// two patterns that conflict) into errors.
func register(mux *http.ServeMux, pattern string, r *route) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("pattern %q: %v; use a net/http.ServeMux pattern such as \"POST /orders\" or \"PATCH /orders/{id}\"", r.pattern, v)
		}
	}()
	mux.Handle(pattern, r) // only matched, never served
	return nil
}

// keepFunc is the KeepFunc of a route: false for the statuses it releases.
func keepFunc(rt Route) (func(int) bool, error) {
	list := rt.ReleaseStatus
	if list == nil {
		list = DefaultReleaseStatus
	}
	release := map[int]bool{}
	for _, s := range list {
		if s < 400 || s > 599 {
			return nil, fmt.Errorf("release status %d: only 4xx and 5xx answers can be released (a success is what a key keeps)", s)
		}
		release[s] = true
	}
	fivexx := rt.Release5xx
	return func(status int) bool { return !release[status] && !(fivexx && status >= 500) }, nil
}

// matchPaths are the paths a request's path is matched as: lower case, with
// segment parameters (";jsessionid=…") dropped, and the same with the trailing
// slash toggled.
func matchPaths(p string) (string, string) {
	if p == "" {
		p = "/"
	}
	p = strings.ToLower(p)
	if strings.IndexByte(p, ';') >= 0 {
		segs := strings.Split(p, "/")
		for i, s := range segs {
			if j := strings.IndexByte(s, ';'); j >= 0 {
				segs[i] = s[:j]
			}
		}
		p = strings.Join(segs, "/")
	}
	// Dot segments and doubled slashes resolved, as routers that clean the
	// path do (ServeMux would otherwise answer with a redirect, not a route).
	slash := strings.HasSuffix(p, "/") || strings.HasSuffix(p, "/.") || strings.HasSuffix(p, "/..")
	p = path.Clean("/" + p)
	if slash && p != "/" {
		p += "/"
	}
	if p == "/" {
		return p, ""
	}
	if t, ok := strings.CutSuffix(p, "/"); ok {
		return p, t
	}
	return p, p + "/"
}

// match returns the route of r, or nil, and whether that route keys r. The
// path is tried as net/http decoded it (as Django, Flask and Spring route)
// and, when it holds percent-escapes, as the client escaped it, segment by
// segment (as Express, Rails and ServeMux route): "/orders/a%2Fb" is one
// segment there, "a/b", and "/orders/%2e%2e" the segment "..", both
// PATCH /orders/{id}. A POST that asks its upstream to take it for another
// method (overrideMethod) is also tried as that method. A route that keys the
// request wins over one that matches its path only.
func (p *Proxy) match(r *http.Request) (*route, bool) {
	type candidate struct {
		path    string
		escaped bool
	}
	var cands []candidate
	first, alt := matchPaths(r.URL.Path)
	cands = append(cands, candidate{first, false}, candidate{alt, false})
	if esc := r.URL.EscapedPath(); strings.IndexByte(esc, '%') >= 0 {
		first, alt := matchPaths(esc)
		cands = append(cands, candidate{first, true}, candidate{alt, true})
	}
	methods := []string{strings.ToUpper(r.Method)}
	if m := overrideMethod(r); m != "" {
		methods = append(methods, m)
	}
	var found *route
	for _, m := range methods {
		for _, c := range cands {
			if rt := p.probe(m, r.Host, c.path, c.escaped); rt != nil {
				if rt.keyed[m] {
					return rt, true
				}
				if found == nil {
					found = rt
				}
			}
		}
	}
	return found, false
}

// methodOverrideHeaders are the headers with which frameworks let a POST stand
// for another method: X-HTTP-Method-Override (Express's method-override, Rack,
// Symfony and Laravel, ASP.NET Core), X-HTTP-Method (OData), X-Method-Override.
var methodOverrideHeaders = []string{"X-Http-Method-Override", "X-Http-Method", "X-Method-Override"}

// overrideMethod is the method a POST asks its upstream to take it for (an
// override header, or a _method query parameter, as Symfony and Laravel read
// it), upper-cased, or "".
func overrideMethod(r *http.Request) string {
	if !strings.EqualFold(r.Method, http.MethodPost) {
		return ""
	}
	for _, h := range methodOverrideHeaders {
		if v := strings.TrimSpace(r.Header.Get(h)); v != "" {
			return strings.ToUpper(v)
		}
	}
	if r.URL.RawQuery != "" {
		if v := strings.TrimSpace(r.URL.Query().Get("_method")); v != "" {
			return strings.ToUpper(v)
		}
	}
	return ""
}

// probe returns the route the mux holds for method and path, or nil; an
// escaped path keeps its escapes (an escaped "/" stays in its segment).
func (p *Proxy) probe(method, host, path string, escaped bool) *route {
	if path == "" {
		return nil
	}
	u := &url.URL{Path: path}
	if escaped {
		dec, err := url.PathUnescape(path)
		if err != nil {
			return nil
		}
		u = &url.URL{Path: dec, RawPath: path}
	}
	probe := &http.Request{Method: method, Host: host, URL: u, RequestURI: path, Header: http.Header{}}
	h, _ := p.mux.Handler(probe)
	rt, _ := h.(*route)
	return rt
}

// ServeHTTP forwards r upstream: through the idem middleware when a route
// matches, as it is otherwise.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	rt, keyed := p.match(r)
	hasKey := len(r.Header.Values(p.keyHeader)) > 0
	if hasKey && !keyed && !safeMethod(r.Method) {
		strict := p.unrouted != nil && p.unrouted.keyed[strings.ToUpper(r.Method)]
		p.unroutedKey(r, strict)
		if strict {
			rt, keyed = p.unrouted, true
		}
	}
	if !keyed {
		p.bare.ServeHTTP(w, r)
		return
	}
	if hasKey {
		if r.Header.Get("Upgrade") != "" {
			writeProblem(w, http.StatusBadRequest, CodeUpgradeRefused, "A keyed request cannot upgrade the connection",
				"the request carries an Idempotency-Key and asks to upgrade the connection ("+r.Header.Get("Upgrade")+"); an upgraded connection has no answer to keep: send it without Upgrade, or without the key")
			return
		}
		scope, err := p.scope.Scope(r)
		if err != nil {
			code := CodeScopeInvalid
			if errors.Is(err, ErrNoScope) {
				code = CodeScopeMissing
			}
			writeProblem(w, http.StatusUnauthorized, code, "The request's scope could not be established", err.Error())
			return
		}
		r = r.WithContext(idem.WithScope(r.Context(), scope))
	}
	defer func() {
		v := recover()
		if v == nil {
			return
		}
		rel, ok := v.(released)
		if !ok {
			panic(v)
		}
		// The middleware released the key on its way out; the client hears why.
		clear(w.Header())
		writeProblem(w, http.StatusBadGateway, CodeUpstreamUnreachable, "The upstream could not be reached",
			"the request did not reach the upstream ("+rel.err.Error()+"), so it cannot have run there and the key was released: retry with the same key")
	}()
	rt.protected.ServeHTTP(w, r)
}

func safeMethod(m string) bool {
	switch strings.ToUpper(m) {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return true
	}
	return false
}

// unroutedKey reports a request that carries a key but matches no keyed
// route: to OnUnrouted every time, to the log once per method and path;
// strict says it is keyed anyway (KeyUnrouted, and a method it keys).
func (p *Proxy) unroutedKey(r *http.Request, strict bool) {
	path, _ := matchPaths(r.URL.Path)
	if len(path) > 200 {
		path = path[:200] + "…"
	}
	method := strings.ToUpper(r.Method)
	if len(method) > 20 {
		method = method[:20] + "…"
	}
	if p.onUnroute != nil {
		p.onUnroute(method, path)
	}
	p.warnMu.Lock()
	defer p.warnMu.Unlock()
	id := method + " " + path
	if p.warned[id] || len(p.warned) > maxWarnedPaths {
		return
	}
	p.warned[id] = true
	what := "passed through unprotected: add a route for it, or start the proxy with --key-unrouted"
	if p.unrouted != nil && !strict {
		what = "passed through unprotected (--key-unrouted keys POST, PUT, PATCH and DELETE only): add a route for it"
	} else if strict {
		what = "keyed anyway (--key-unrouted), with the default route settings"
	}
	more := ""
	if len(p.warned) > maxWarnedPaths {
		more = " (further paths are counted, not logged)"
	}
	p.log.Printf("idem proxy: warning: %q carries an Idempotency-Key but matches no keyed route; it is %s%s", id, what, more)
}

// InFlight is a keyed request at the upstream.
type InFlight struct {
	Scope, Key, Method, Path string
	Since                    time.Time
}

// InFlight lists the keyed requests at the upstream now, oldest first: at
// shutdown, those that are still there when the drain ends are abandoned, and
// their outcome unknown.
func (p *Proxy) InFlight() []InFlight {
	p.up.mu.Lock()
	out := make([]InFlight, 0, len(p.up.inflight))
	for c := range p.up.inflight {
		out = append(out, c.info)
	}
	p.up.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Since.Before(out[j].Since) })
	return out
}

// DrainTimeout is how long a shutdown should wait for keyed requests in
// flight: their upstream call (UpstreamTimeout), then the middleware's
// recording of the outcome (idem.DefaultCleanupTimeout), with a second to
// spare.
func (p *Proxy) DrainTimeout() time.Duration {
	return p.timeout + time.Second + idem.DefaultCleanupTimeout
}

// released is the panic that carries an unreachable upstream out of the
// middleware, which releases the key of a handler that panics: nothing was
// sent, so a retry must run afresh.
type released struct{ err error }

// upstream is the handler behind the middleware: one upstream call.
type upstream struct {
	rp       *httputil.ReverseProxy // pooled connections: unkeyed requests
	keyedRP  *httputil.ReverseProxy // a fresh connection per request: keyed ones
	timeout  time.Duration
	log      *log.Logger
	buffered int64     // the route's MaxStoredBody: see bufferAnswer
	tracker  *upstream // keeps the in-flight set

	mu       sync.Mutex
	inflight map[*call]struct{}
}

type callKey struct{}

// call is what the proxy learnt about one upstream call.
type call struct {
	keyed       bool
	unreachable error
	buffered    int64 // how much of a keyed answer's body is read before it is passed on
	streamed    bool  // the answer was longer: it streams after that part
	origin      string
	info        InFlight

	gotConn      atomic.Bool
	wroteHeaders atomic.Bool
	conn         atomic.Pointer[countConn]
	written0     int64 // the connection's writes when the request got it (a TLS handshake's)
}

func (c *call) trace() *httptrace.ClientTrace {
	return &httptrace.ClientTrace{
		GotConn: func(info httptrace.GotConnInfo) {
			var cc *countConn
			switch conn := info.Conn.(type) {
			case *countConn:
				cc = conn
			case *tls.Conn:
				cc, _ = conn.NetConn().(*countConn)
			}
			if cc != nil {
				c.written0 = cc.writes.Load()
				c.conn.Store(cc)
			}
			c.gotConn.Store(true)
		},
		WroteHeaders: func() { c.wroteHeaders.Store(true) },
	}
}

// notSent says why a failed call's request cannot have reached the upstream:
// no connection (a refused dial, a TLS handshake that failed) or not a byte
// of it written; "" when it may have.
func (c *call) notSent() string {
	if !c.gotConn.Load() {
		return "no connection was established"
	}
	cc := c.conn.Load()
	if cc == nil { // a Transport of the caller's: only what httptrace says
		if !c.wroteHeaders.Load() {
			return "nothing was written"
		}
		return ""
	}
	if cc.writes.Load() == c.written0 {
		return "nothing was written"
	}
	// Some of it was: the upstream may have acted on what it read (most
	// frameworks run a handler once its headers are in).
	return ""
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	scope, key, keyed := idem.KeyFrom(r.Context())
	c := &call{keyed: keyed, buffered: u.buffered}
	ctx := context.WithValue(r.Context(), callKey{}, c)
	rp := u.rp
	if keyed {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(httptrace.WithClientTrace(ctx, c.trace()), u.timeout)
		defer cancel()
		rp = u.keyedRP
		c.info = InFlight{Scope: scope, Key: key, Method: r.Method, Path: r.URL.Path, Since: time.Now()}
		if t := u.tracker; t != nil {
			t.mu.Lock()
			t.inflight[c] = struct{}{}
			t.mu.Unlock()
			defer func() {
				t.mu.Lock()
				delete(t.inflight, c)
				t.mu.Unlock()
			}()
		}
		defer func() {
			if v := recover(); v != nil {
				if v != http.ErrAbortHandler {
					panic(v)
				}
				// The upstream's answer broke off after it began (past the part
				// bufferAnswer read): the operation ran, with an outcome the client
				// could not hear.
				idem.MarkOutcomeUnknown(r.Context())
				u.log.Printf("idem proxy: %s %s: the upstream's answer broke off; the outcome of key %q is unknown", r.Method, r.URL.Path, key)
				if c.streamed {
					// Its start already went to the client (the middleware stored the
					// outcome without its body, too large to keep): the client must see
					// the answer break off too, not a well-formed end after the part.
					panic(v)
				}
			}
		}()
	} else {
		// Unkeyed traffic is passed through: it streams (uploads, websockets)
		// as long as both ends want, not bounded by the server's ReadTimeout.
		_ = http.NewResponseController(w).SetReadDeadline(time.Time{})
	}
	out := r.WithContext(ctx)
	if keyed {
		// The middleware buffered the body (the bytes it fingerprinted): it goes
		// upstream with their Content-Length, never chunked, which upstreams
		// that read by Content-Length (Python's http.server) cannot parse.
		body, err := io.ReadAll(r.Body)
		if err != nil {
			panic(err)
		}
		out.Body, out.ContentLength, out.TransferEncoding = http.NoBody, 0, nil
		if len(body) > 0 {
			out.Body, out.ContentLength = io.NopCloser(bytes.NewReader(body)), int64(len(body))
		}
		out.Header = r.Header.Clone()
		// The body is here already: waiting for 100 Continue would only delay
		// it (or store the upstream's 417).
		out.Header.Del("Expect")
	}
	rp.ServeHTTP(w, out)
	if c.unreachable != nil {
		panic(released{c.unreachable})
	}
}

// failed is the ReverseProxy's ErrorHandler: the upstream call failed before an
// answer began.
func (u *upstream) failed(w http.ResponseWriter, r *http.Request, err error) {
	c, _ := r.Context().Value(callKey{}).(*call)
	keyed := c != nil && c.keyed
	why := ""
	var op *net.OpError
	if errors.As(err, &op) && op.Op == "dial" {
		why = "the connection was refused"
	} else if keyed && !errors.Is(err, context.DeadlineExceeded) {
		why = c.notSent()
	}
	switch {
	case why != "":
		if keyed {
			c.unreachable = fmt.Errorf("%s: %w", why, err) // answered outside the middleware, after the release
			return
		}
		writeProblem(w, http.StatusBadGateway, CodeUpstreamUnreachable, "The upstream could not be reached",
			"the request did not reach the upstream ("+why+": "+err.Error()+")")
	case !keyed:
		writeProblem(w, http.StatusBadGateway, CodeUpstreamFailed, "The upstream failed",
			"the upstream failed ("+err.Error()+"); the request carried no key, so nothing was recorded")
	case errors.Is(err, context.DeadlineExceeded):
		idem.MarkOutcomeUnknown(r.Context())
		u.log.Printf("idem proxy: %s %s: no answer from the upstream within %v; the outcome of key %q is unknown", r.Method, r.URL.Path, u.timeout, c.info.Key)
		writeProblem(w, http.StatusGatewayTimeout, CodeUpstreamTimeout, "The upstream did not answer in time",
			fmt.Sprintf("the upstream did not answer within %v, so whether the operation took effect is unknown; a retry with the same key gets 409 while the lease runs, then the outcome once known, or 503 idempotency_outcome_unknown until an operator resolves the key", u.timeout))
	default:
		idem.MarkOutcomeUnknown(r.Context())
		u.log.Printf("idem proxy: %s %s: upstream failed mid-request: %v; the outcome of key %q is unknown", r.Method, r.URL.Path, err, c.info.Key)
		writeProblem(w, http.StatusBadGateway, CodeUpstreamFailed, "The upstream failed mid-request",
			"the upstream failed after the request was sent ("+err.Error()+"), so whether the operation took effect is unknown; a retry with the same key gets 409 while the lease runs, then 503 idempotency_outcome_unknown until an operator resolves the key (or a second execution, when the upstream is configured as safe to repeat)")
	}
}

// forwarding is what the proxy does to requests on their way up and answers
// on their way back.
type forwarding struct {
	upstream        *url.URL
	trusted         []netip.Prefix
	preserveHost    bool
	customTransport bool // Config.Transport was set: see rewrite
}

func (f *forwarding) trustedPeer(remoteAddr string) bool {
	if len(f.trusted) == 0 {
		return false
	}
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		host = remoteAddr
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false
	}
	ip = ip.Unmap()
	for _, p := range f.trusted {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// rewrite points the outgoing request at upstream. ReverseProxy removes the
// hop-by-hop headers (Connection and the headers it names, Keep-Alive,
// Proxy-*, TE, Trailer, Transfer-Encoding, Upgrade) in both directions.
func (f *forwarding) rewrite(pr *httputil.ProxyRequest) {
	in, out := pr.In, pr.Out
	pr.SetURL(f.upstream)
	// X-Forwarded-For is appended to, whoever sent it (nginx's
	// $proxy_add_x_forwarded_for): the upstream reads it from the right.
	if xff := in.Header.Values("X-Forwarded-For"); len(xff) > 0 {
		out.Header["X-Forwarded-For"] = slices.Clone(xff)
	}
	pr.SetXForwarded()
	proto := "http"
	if in.TLS != nil {
		proto = "https"
	}
	host := in.Host
	if f.trustedPeer(in.RemoteAddr) {
		if v := in.Header.Values("X-Forwarded-Proto"); len(v) > 0 {
			out.Header["X-Forwarded-Proto"] = slices.Clone(v)
			proto = strings.TrimSpace(strings.Split(v[len(v)-1], ",")[0])
		}
		if v := in.Header.Values("X-Forwarded-Host"); len(v) > 0 {
			out.Header["X-Forwarded-Host"] = slices.Clone(v)
			host = strings.TrimSpace(strings.Split(v[len(v)-1], ",")[0])
		}
		if v := in.Header.Values("Forwarded"); len(v) > 0 {
			out.Header.Set("Forwarded", strings.Join(append(slices.Clone(v), forwardedFor(in.RemoteAddr)), ", "))
			// A gateway that sends only Forwarded (RFC 7239): upstreams that read
			// X-Forwarded-Proto and -Host (Django's SECURE_PROXY_SSL_HEADER,
			// Rails) learn the same from them. Its own element is the last.
			if len(in.Header.Values("X-Forwarded-Proto")) == 0 {
				if p := forwardedParam(v, "proto"); p != "" {
					out.Header.Set("X-Forwarded-Proto", p)
					proto = p
				}
			}
			if len(in.Header.Values("X-Forwarded-Host")) == 0 {
				if h := forwardedParam(v, "host"); h != "" {
					out.Header.Set("X-Forwarded-Host", h)
					host = h
				}
			}
		}
	} else {
		out.Header.Del("Forwarded")
		for _, h := range forwardingHeaders {
			out.Header.Del(h)
		}
	}
	if f.preserveHost {
		out.Host = in.Host
	}
	c, _ := in.Context().Value(callKey{}).(*call)
	if c != nil {
		c.origin = proto + "://" + host
	}
	fresh := c != nil && c.keyed && !f.customTransport // the keyed transport: never a reused connection
	if !fresh && (out.Body == nil || out.Body == http.NoBody) && replayableByKey(out) {
		// net/http's Transport re-sends a request without a body that carries an
		// Idempotency-Key when a reused connection fails after the request was
		// written, which could run the operation twice. It looks the header up
		// by its canonical name: sent under its lower-case name (header names
		// are case-insensitive; HTTP/2 lower-cases them anyway), the request is
		// not replayable. (A body of its own would make it so too, but go up
		// chunked.) This matters for a request passed through unprotected (it
		// matched no keyed route) on a pooled connection, and for any request
		// on a Transport of the caller's.
		for _, h := range []string{"Idempotency-Key", "X-Idempotency-Key"} {
			if v, ok := out.Header[h]; ok {
				delete(out.Header, h)
				out.Header[strings.ToLower(h)] = v
			}
		}
	}
}

// forwardingHeaders are the other headers with which a hop in front tells the
// upstream how the client reached it; upstreams trust them from the proxy's
// address (gunicorn's secure_scheme_headers and Rails' trusted proxies include
// loopback by default), so a client must not be able to set them: they pass
// from a trusted hop only, as X-Forwarded-Proto and -Host.
var forwardingHeaders = []string{
	"X-Forwarded-Ssl", "X-Forwarded-Scheme", "X-Forwarded-Protocol", "X-Forwarded-Port",
	"X-Forwarded-Prefix", "X-Forwarded-Server", "X-Url-Scheme", "Front-End-Https", "X-Real-Ip",
}

// forwardedParam is the value of param in the last element of the Forwarded
// header lines v (the one the nearest hop added), unquoted, or "".
func forwardedParam(v []string, param string) string {
	elems := strings.Split(v[len(v)-1], ",")
	for _, pair := range strings.Split(elems[len(elems)-1], ";") {
		k, val, ok := strings.Cut(strings.TrimSpace(pair), "=")
		if ok && strings.EqualFold(strings.TrimSpace(k), param) {
			val = strings.TrimSpace(val)
			if len(val) >= 2 && val[0] == '"' && val[len(val)-1] == '"' {
				val = val[1 : len(val)-1]
			}
			return val
		}
	}
	return ""
}

// forwardedFor is the Forwarded element (RFC 7239) of the peer at remoteAddr.
func forwardedFor(remoteAddr string) string {
	host, _, err := net.SplitHostPort(remoteAddr)
	if err != nil {
		host = remoteAddr
	}
	if strings.Contains(host, ":") {
		return `for="[` + host + `]"`
	}
	return "for=" + host
}

// modifyResponse is the ReverseProxy's ModifyResponse: it rewrites a Location
// that names the upstream, then buffers a keyed answer (bufferAnswer).
func (f *forwarding) modifyResponse(res *http.Response) error {
	c, _ := res.Request.Context().Value(callKey{}).(*call)
	if c != nil && c.origin != "" {
		if loc := res.Header.Get("Location"); loc != "" {
			if u, err := url.Parse(loc); err == nil && u.IsAbs() && strings.EqualFold(u.Scheme, f.upstream.Scheme) && strings.EqualFold(u.Host, f.upstream.Host) {
				p := u.EscapedPath()
				if prefix := strings.TrimSuffix(f.upstream.EscapedPath(), "/"); prefix != "" {
					if rest, ok := strings.CutPrefix(p, prefix); ok && (rest == "" || rest[0] == '/') {
						p = rest
					}
				}
				if p == "" {
					p = "/"
				}
				nu := c.origin + p
				if u.RawQuery != "" {
					nu += "?" + u.RawQuery
				}
				if u.Fragment != "" {
					nu += "#" + u.EscapedFragment()
				}
				res.Header.Set("Location", nu)
			}
		}
	}
	return bufferAnswer(c, res)
}

// bufferAnswer reads the body of a keyed request's answer (up to the route's
// MaxStoredBody, which the middleware buffers anyway) before any of it is
// passed on, so that an upstream that breaks its answer off there is the
// documented 502 upstream_failed (the outcome unknown): once the status and
// part of the body reached the middleware, the broken answer could only be
// sent on as it was — a 201 with half a body and a Content-Length that matched
// it. An answer longer than that streams after its first part; if it breaks
// off later, so does the answer the client gets.
func bufferAnswer(c *call, res *http.Response) error {
	if c == nil || !c.keyed || res.StatusCode < 200 || res.Body == nil || res.Body == http.NoBody {
		return nil // a 101's body is the upgraded connection: not to be read here
	}
	buf, err := io.ReadAll(io.LimitReader(res.Body, c.buffered+1))
	if err != nil {
		return fmt.Errorf("reading the answer's body: %w", err)
	}
	if int64(len(buf)) <= c.buffered {
		res.Body = readCloser{bytes.NewReader(buf), res.Body}
	} else {
		// Longer than the middleware keeps: it streams the answer once its
		// buffer overflows, which this part does.
		c.streamed = true
		res.Body = readCloser{io.MultiReader(bytes.NewReader(buf), res.Body), res.Body}
	}
	return nil
}

type readCloser struct {
	io.Reader
	io.Closer
}

// replayableByKey reports whether net/http would treat a bodiless r as
// replayable because of its key header (GET-like methods are anyway).
func replayableByKey(r *http.Request) bool {
	switch r.Method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace:
		return false
	}
	return len(r.Header["Idempotency-Key"]) > 0 || len(r.Header["X-Idempotency-Key"]) > 0
}

func writeProblem(w http.ResponseWriter, status int, code, title, detail string) {
	idem.WriteProblem(w, idem.Problem{Type: ProblemTypeBase + code, Title: title, Status: status, Detail: detail, Code: code}, 0)
}
