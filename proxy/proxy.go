package proxy

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// ProblemTypeBase prefixes the type URI of the proxy's own problems; the
// fragment is the problem's code, documented in docs/proxy.md.
const ProblemTypeBase = "https://github.com/idemkit/idem/blob/main/docs/proxy.md#"

// Problem codes of the proxy's own answers (application/problem+json, with the
// code in the "code" member, as idem's). They are API.
const (
	// CodeUpstreamUnreachable (502): the upstream could not be connected to, so
	// the request was not sent; the key was released and a retry runs afresh.
	CodeUpstreamUnreachable = "upstream_unreachable"
	// CodeUpstreamFailed (502): the upstream failed after the request was sent
	// (it closed the connection or broke off its answer), so whether the operation
	// took effect is unknown; the key stays in flight until its lease lapses.
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
)

// DefaultUpstreamTimeout bounds an upstream call when Config.UpstreamTimeout is
// zero.
const DefaultUpstreamTimeout = 30 * time.Second

// Route says which requests are keyed and how their records are kept. The zero
// values of its limits are idem's defaults (idem.Config).
type Route struct {
	// Pattern is a net/http.ServeMux pattern: "POST /orders",
	// "PATCH /orders/{id}", "/payments/" (a subtree). Without a method, POST and
	// PATCH are keyed; with one, that method is.
	Pattern string
	// KeyOptional lets keyed requests without a key through to the upstream,
	// unprotected. Defaults to false: they get 400 idempotency_key_missing.
	KeyOptional bool
	// TTL is how long an outcome is kept and replayed (idem.Config.TTL).
	TTL time.Duration
	// Lease is the in-flight lease, renewed while the upstream works
	// (idem.Config.Lease).
	Lease time.Duration
	// StoredHeaders are the upstream's response headers kept for replay
	// (idem.Config.StoredHeaders); nil for idem.DefaultStoredHeaders.
	StoredHeaders []string
	// MaxRequestBody is the largest request body buffered and fingerprinted;
	// larger gets 413 (idem.Config.MaxRequestBody).
	MaxRequestBody int64
	// MaxStoredBody is the largest response body kept for replay
	// (idem.Config.MaxStoredBody).
	MaxStoredBody int
	// Release5xx passes an upstream's 5xx answer on without keeping it, and
	// releases the key, so that a retry runs the operation again. Set it only
	// when the upstream's 5xx answers never leave effects behind. By default
	// every answer the upstream completes is kept and replayed for TTL, 5xx
	// included: the upstream may have acted before it failed.
	Release5xx bool
}

// below500 is the KeepFunc of a route with Release5xx.
func below500(status int) bool { return status < 500 }

// DefaultRoutes is what Config.Routes means when empty: POST and PATCH keyed on
// every path.
var DefaultRoutes = []Route{{Pattern: "/"}}

// Config configures a Proxy. Upstream and Store are required.
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
	// JWTScope). Defaults to nil: every request shares the scope "".
	Scope Scope
	// RepeatSafe says that running an operation twice is harmless at the
	// upstream. Only then does a retry that finds a lapsed lease (the upstream
	// or a proxy died mid-request) run the operation again; otherwise it gets
	// 503 idempotency_outcome_unknown until an operator resolves the key with
	// `idem resolve`. Defaults to false.
	RepeatSafe bool
	// UpstreamTimeout bounds each upstream call, from sending the request to the
	// end of the answer. Defaults to DefaultUpstreamTimeout.
	UpstreamTimeout time.Duration
	// Transport sends requests upstream. Defaults to a clone of
	// http.DefaultTransport that keeps up to 256 idle connections.
	Transport http.RoundTripper
	// Observer is told about every decision of the middleware.
	Observer idem.Observer
	// ErrorLog receives the upstream errors. Defaults to the log package's
	// standard logger.
	ErrorLog *log.Logger
}

// Proxy is an http.Handler that forwards to the upstream, keyed routes through
// the idem middleware.
type Proxy struct {
	mux       *http.ServeMux
	routes    map[string]*route
	bare      http.Handler
	scope     Scope
	keyHeader string
	log       *log.Logger
}

type route struct {
	protected http.Handler
	keyed     map[string]bool
}

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
	if cfg.UpstreamTimeout == 0 {
		cfg.UpstreamTimeout = DefaultUpstreamTimeout
	} else if cfg.UpstreamTimeout < 0 {
		return nil, fmt.Errorf("proxy: UpstreamTimeout %v: use a positive duration", cfg.UpstreamTimeout)
	}
	if cfg.Transport == nil {
		t := http.DefaultTransport.(*http.Transport).Clone()
		t.MaxIdleConns = 256
		t.MaxIdleConnsPerHost = 256
		cfg.Transport = t
	}
	if cfg.ErrorLog == nil {
		cfg.ErrorLog = log.Default()
	}
	if len(cfg.Routes) == 0 {
		cfg.Routes = DefaultRoutes
	}
	p := &Proxy{mux: http.NewServeMux(), routes: map[string]*route{}, scope: cfg.Scope, keyHeader: idem.DefaultHeaderName, log: cfg.ErrorLog}
	up := &upstream{timeout: cfg.UpstreamTimeout, log: cfg.ErrorLog}
	up.rp = &httputil.ReverseProxy{
		Rewrite:        rewrite(cfg.Upstream),
		Transport:      cfg.Transport,
		ErrorHandler:   up.failed,
		ModifyResponse: bufferAnswer,
		ErrorLog:       cfg.ErrorLog,
		FlushInterval:  -1,
	}
	p.bare = up
	lapsed := idem.LapsedRefuse
	if cfg.RepeatSafe {
		lapsed = idem.LapsedTakeOver
	}
	store := plainStore{cfg.Store}
	for i, rt := range cfg.Routes {
		methods := idem.DefaultMethods
		if m, _, ok := strings.Cut(strings.TrimSpace(rt.Pattern), " "); ok && !strings.HasPrefix(m, "/") {
			methods = []string{m}
		}
		var keep func(int) bool
		if rt.Release5xx {
			keep = below500
		}
		mw, err := idem.New(store, &idem.Config{
			KeepFunc:       keep,
			Methods:        methods,
			KeyOptional:    rt.KeyOptional,
			Lease:          rt.Lease,
			TTL:            rt.TTL,
			MaxRequestBody: rt.MaxRequestBody,
			MaxStoredBody:  rt.MaxStoredBody,
			StoredHeaders:  rt.StoredHeaders,
			Flow:           idem.FlowClaimComplete,
			Observer:       cfg.Observer,
			LapsedLease:    lapsed,
			// The upstream call ends first, with a clear answer (upstream_timeout).
			HandlerTimeout: cfg.UpstreamTimeout + time.Second,
		})
		if err != nil {
			return nil, fmt.Errorf("proxy: route %d (%q): %w", i+1, rt.Pattern, err)
		}
		if _, dup := p.routes[rt.Pattern]; dup {
			return nil, fmt.Errorf("proxy: route %d: pattern %q is listed twice", i+1, rt.Pattern)
		}
		buffered := int64(rt.MaxStoredBody)
		if buffered == 0 {
			buffered = idem.DefaultMaxStoredBody
		}
		rup := &upstream{rp: up.rp, timeout: up.timeout, log: up.log, buffered: buffered}
		r := &route{protected: mw(rup), keyed: map[string]bool{}}
		for _, m := range methods {
			r.keyed[strings.ToUpper(m)] = true
		}
		if err := register(p.mux, rt.Pattern); err != nil {
			return nil, fmt.Errorf("proxy: route %d: %w", i+1, err)
		}
		p.routes[rt.Pattern] = r
	}
	return p, nil
}

// register adds pattern to mux, turning ServeMux's panics (an invalid pattern,
// two patterns that conflict) into errors.
func register(mux *http.ServeMux, pattern string) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("pattern %q: %v; use a net/http.ServeMux pattern such as \"POST /orders\" or \"PATCH /orders/{id}\"", pattern, v)
		}
	}()
	mux.Handle(pattern, http.NotFoundHandler()) // only matched, never served
	return nil
}

// ServeHTTP forwards r upstream: through the idem middleware when a route
// matches, as it is otherwise.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, pattern := p.mux.Handler(r)
	rt := p.routes[pattern]
	if rt == nil {
		p.bare.ServeHTTP(w, r)
		return
	}
	if p.scope != nil && len(r.Header.Values(p.keyHeader)) > 0 && rt.keyed[strings.ToUpper(r.Method)] {
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
			"the upstream could not be connected to ("+rel.err.Error()+"), so the request was not sent and the key was released: retry with the same key")
	}()
	rt.protected.ServeHTTP(w, r)
}

// released is the panic that carries an unreachable upstream out of the
// middleware, which releases the key of a handler that panics: nothing was
// sent, so a retry must run afresh.
type released struct{ err error }

// upstream is the handler behind the middleware: one upstream call.
type upstream struct {
	rp       *httputil.ReverseProxy
	timeout  time.Duration
	log      *log.Logger
	buffered int64 // the route's MaxStoredBody: see bufferAnswer
}

type callKey struct{}

// call is what the error handler learnt about one upstream call.
type call struct {
	keyed       bool
	unreachable error
	buffered    int64 // how much of a keyed answer's body is read before it is passed on
	streamed    bool  // the answer was longer: it streams after that part
}

func (u *upstream) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	_, _, keyed := idem.KeyFrom(r.Context())
	c := &call{keyed: keyed, buffered: u.buffered}
	ctx, cancel := context.WithTimeout(context.WithValue(r.Context(), callKey{}, c), u.timeout)
	defer cancel()
	if keyed {
		defer func() {
			if v := recover(); v != nil {
				if v != http.ErrAbortHandler {
					panic(v)
				}
				// The upstream's answer broke off after it began (past the part
				// bufferAnswer read): the operation ran, with an outcome the client
				// could not hear.
				idem.MarkOutcomeUnknown(r.Context())
				u.log.Printf("idem proxy: %s %s: the upstream's answer broke off; the outcome of key %q is unknown", r.Method, r.URL.Path, keyOf(r))
				if c.streamed {
					// Its start already went to the client (the middleware stored the
					// outcome without its body, too large to keep): the client must see
					// the answer break off too, not a well-formed end after the part.
					panic(v)
				}
			}
		}()
	}
	u.rp.ServeHTTP(w, r.WithContext(ctx))
	if c.unreachable != nil {
		panic(released{c.unreachable})
	}
}

func keyOf(r *http.Request) string {
	_, k, _ := idem.KeyFrom(r.Context())
	return k
}

// failed is the ReverseProxy's ErrorHandler: the upstream call failed before an
// answer began.
func (u *upstream) failed(w http.ResponseWriter, r *http.Request, err error) {
	c, _ := r.Context().Value(callKey{}).(*call)
	var op *net.OpError
	switch {
	case errors.As(err, &op) && op.Op == "dial":
		if c != nil && c.keyed {
			c.unreachable = err // answered outside the middleware, after the release
			return
		}
		writeProblem(w, http.StatusBadGateway, CodeUpstreamUnreachable, "The upstream could not be reached",
			"the upstream could not be connected to ("+err.Error()+"), so the request was not sent")
	case errors.Is(err, context.DeadlineExceeded):
		idem.MarkOutcomeUnknown(r.Context())
		u.log.Printf("idem proxy: %s %s: no answer from the upstream within %v; the outcome of key %q is unknown", r.Method, r.URL.Path, u.timeout, keyOf(r))
		writeProblem(w, http.StatusGatewayTimeout, CodeUpstreamTimeout, "The upstream did not answer in time",
			fmt.Sprintf("the upstream did not answer within %v, so whether the operation took effect is unknown; a retry with the same key gets 409 while the lease runs, then the outcome once known, or 503 idempotency_outcome_unknown until an operator resolves the key", u.timeout))
	default:
		idem.MarkOutcomeUnknown(r.Context())
		u.log.Printf("idem proxy: %s %s: upstream failed mid-request: %v; the outcome of key %q is unknown", r.Method, r.URL.Path, err, keyOf(r))
		writeProblem(w, http.StatusBadGateway, CodeUpstreamFailed, "The upstream failed mid-request",
			"the upstream failed after the request was sent ("+err.Error()+"), so whether the operation took effect is unknown; a retry with the same key gets 409 while the lease runs, then 503 idempotency_outcome_unknown until an operator resolves the key (or a second execution, when the upstream is configured as safe to repeat)")
	}
}

// bufferAnswer is the ReverseProxy's ModifyResponse. It reads the body of a
// keyed request's answer (up to the route's MaxStoredBody, which the middleware
// buffers anyway) before any of it is passed on, so that an upstream that
// breaks its answer off there is the documented 502 upstream_failed (the
// outcome unknown): once the status and part of the body reached the
// middleware, the broken answer could only be sent on as it was — a 201 with
// half a body and a Content-Length that matched it. An answer longer than that
// streams after its first part; if it breaks off later, so does the answer the
// client gets.
func bufferAnswer(res *http.Response) error {
	c, _ := res.Request.Context().Value(callKey{}).(*call)
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

// rewrite points the outgoing request at upstream. ReverseProxy removes the
// hop-by-hop headers (Connection and the headers it names, Keep-Alive,
// Proxy-*, TE, Trailer, Transfer-Encoding, Upgrade) in both directions.
func rewrite(upstream *url.URL) func(*httputil.ProxyRequest) {
	return func(pr *httputil.ProxyRequest) {
		pr.SetURL(upstream)
		pr.SetXForwarded()
		out := pr.Out
		if (out.Body == nil || out.Body == http.NoBody) && replayableByKey(out) {
			// net/http's Transport re-sends a request without a body that carries an
			// Idempotency-Key when a reused connection fails after the request was
			// written, which could run the operation twice: a body of its own
			// makes it not replayable (it is still sent as Content-Length: 0).
			out.Body, out.ContentLength = emptyBody{}, 0
		} else if l, ok := out.Body.(interface{ Len() int }); ok && out.ContentLength < 0 {
			// The middleware buffered the whole body: send its length, not chunks,
			// which some upstreams (Python's http.server) cannot read.
			out.ContentLength = int64(l.Len())
			out.TransferEncoding = nil
		}
	}
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

type emptyBody struct{}

func (emptyBody) Read([]byte) (int, error) { return 0, io.EOF }
func (emptyBody) Close() error             { return nil }

func writeProblem(w http.ResponseWriter, status int, code, title, detail string) {
	idem.WriteProblem(w, idem.Problem{Type: ProblemTypeBase + code, Title: title, Status: status, Detail: detail, Code: code}, 0)
}
