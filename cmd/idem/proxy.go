package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/proxy"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

func init() {
	register(&command{
		name:    "proxy",
		summary: "a sidecar reverse proxy that gives any HTTP API the Idempotency-Key contract",
		run:     runProxy,
	})
}

const proxyUsage = `Usage: idem proxy --upstream URL --db URL [flags]

Forwards requests to the upstream; POST and PATCH (or the --route patterns)
carry an Idempotency-Key: one execution per key at the upstream, and every retry
gets the stored answer. It also serves GET /healthz and GET /metrics
(Prometheus). Several routes: --config FILE (YAML; flags win over the file).

After an upstream (or proxy) died mid-request the outcome is unknown: retries
get 503 idempotency_outcome_unknown until you resolve the key with
idem resolve, unless --repeat-safe says the upstream may run it twice.

Example:
  idem proxy --listen 127.0.0.1:8081 --upstream http://127.0.0.1:3000 \
    --db sqlite:keys.db --route 'POST /orders' --scope-header X-Tenant-ID

Flags:
`

type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ", ") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

type sizeFlag int64

func (s *sizeFlag) String() string { return fmt.Sprint(int64(*s)) }
func (s *sizeFlag) Set(v string) error {
	n, err := proxy.ParseSize(v)
	if err == nil {
		*s = sizeFlag(n)
	}
	return err
}

var proxyEnv = append([]storeEnvVar{{"listen", "IDEM_PROXY_LISTEN"}, {"upstream", "IDEM_PROXY_UPSTREAM"}}, storeCmdEnv...)

func runProxy(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem proxy", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:8081", "listen address; port 0 picks a free one (first output line: idem proxy: listening on http://HOST:PORT)")
	upstream := fs.String("upstream", "", "the upstream's base URL, such as http://127.0.0.1:3000")
	db, keys, table := storeFlags(fs, "")
	config := fs.String("config", "", "a YAML file with routes, scope and the settings below")
	var routes, stored multiFlag
	fs.Var(&routes, "route", "a keyed route, as a ServeMux pattern ('POST /orders', 'PATCH /orders/{id}'); repeatable; default: POST and PATCH on every path")
	keyOptional := fs.Bool("key-optional", false, "let keyed requests without a key through, unprotected (default: 400)")
	ttl := fs.Duration("ttl", 0, "how long outcomes are kept and replayed (default 24h)")
	lease := fs.Duration("lease", 0, "in-flight lease, renewed while the upstream works (default 30s)")
	fs.Var(&stored, "stored-header", "a response header kept for replay; repeatable (default: Content-Type, Location, ETag and the other idem defaults)")
	var maxReq, maxStored sizeFlag
	fs.Var(&maxReq, "max-request-body", "largest request body buffered and fingerprinted, such as 1MiB (default 1MiB)")
	fs.Var(&maxStored, "max-stored-body", "largest response body kept for replay, such as 1MiB (default 1MiB)")
	scopeHeader := fs.String("scope-header", "", "take the tenant from this request header (set by a gateway that authenticated the caller)")
	scopeBearer := fs.Bool("scope-bearer", false, "the bearer token is the tenant (stored as its SHA-256)")
	jwtClaim := fs.String("scope-jwt-claim", "", "take the tenant from this claim of a bearer JWT verified with --jwks-file")
	jwksFile := fs.String("jwks-file", "", "the JSON Web Key Set that verifies JWTs")
	jwtIssuer := fs.String("jwt-issuer", "", "the iss a JWT must have")
	jwtAudience := fs.String("jwt-audience", "", "an aud a JWT must have")
	release5xx := fs.Bool("release-5xx", false, "pass an upstream 5xx on without keeping it, and release the key so that a retry runs again (only for upstreams whose 5xx leaves no effects; default: kept and replayed like any answer)")
	repeatSafe := fs.Bool("repeat-safe", false, "the upstream may run an operation twice: after a lapsed lease, run it again instead of 503 idempotency_outcome_unknown")
	timeout := fs.Duration("upstream-timeout", 0, "bound on each upstream call (default 30s); past it: 504 upstream_timeout, outcome unknown")
	fs.Usage = storeUsage(fs, proxyUsage, proxyEnv)
	pos, code, ok := storeParse(fs, args, proxyEnv, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) > 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("unexpected argument %q; idem proxy takes flags only", pos[0]))
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })

	file := &proxy.File{}
	if *config != "" {
		var err error
		if file, err = proxy.LoadFile(*config); err != nil {
			return storeUsageError(stderr, fs, err.Error())
		}
	}
	pick := func(flagName, flagVal, fileVal string) string {
		if set[flagName] || fileVal == "" {
			return flagVal
		}
		return fileVal
	}
	*listen = pick("listen", *listen, file.Listen)
	*upstream = pick("upstream", *upstream, file.Upstream)
	*db = pick("db", *db, file.DB)
	*keys = pick("keys", *keys, file.Keys)
	*table = pick("table", *table, file.Table)
	if !set["repeat-safe"] {
		*repeatSafe = file.RepeatSafe
	}
	if !set["upstream-timeout"] {
		*timeout = time.Duration(file.UpstreamTimeout)
	}
	if *upstream == "" {
		return storeUsageError(stderr, fs, "--upstream is required; for example --upstream http://127.0.0.1:3000")
	}
	up, err := url.Parse(*upstream)
	if err != nil || (up.Scheme != "http" && up.Scheme != "https") || up.Host == "" {
		return storeUsageError(stderr, fs, fmt.Sprintf("--upstream %q is not an http:// or https:// URL with a host", *upstream))
	}
	if *db == "" {
		return storeUsageError(stderr, fs, "--db is required; for example --db sqlite:keys.db or --db postgres://…")
	}

	rts, err := file.ProxyRoutes()
	if err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	if len(routes) > 0 {
		rts = nil
		for _, p := range routes {
			rts = append(rts, proxy.Route{Pattern: p})
		}
	}
	if len(rts) == 0 {
		rts = append(rts, proxy.DefaultRoutes...)
	}
	for i := range rts { // flags apply to every route
		r := &rts[i]
		r.KeyOptional = r.KeyOptional || *keyOptional
		r.Release5xx = r.Release5xx || *release5xx
		if set["ttl"] {
			r.TTL = *ttl
		}
		if set["lease"] {
			r.Lease = *lease
		}
		if len(stored) > 0 {
			r.StoredHeaders = stored
		}
		if set["max-request-body"] {
			r.MaxRequestBody = int64(maxReq)
		}
		if set["max-stored-body"] {
			r.MaxStoredBody = int(maxStored)
		}
	}

	var scope proxy.Scope
	sources := 0
	for _, on := range []bool{*scopeHeader != "", *scopeBearer, *jwtClaim != "" || *jwksFile != ""} {
		if on {
			sources++
		}
	}
	switch {
	case sources > 1:
		return storeUsageError(stderr, fs, "give one scope source: --scope-header, --scope-bearer, or --scope-jwt-claim with --jwks-file")
	case *scopeHeader != "":
		scope = proxy.HeaderScope(*scopeHeader)
	case *scopeBearer:
		scope = proxy.BearerScope()
	case *jwksFile != "":
		jwks, err := proxy.LoadJWKS(*jwksFile)
		if err != nil {
			return storeUsageError(stderr, fs, "--jwks-file: "+err.Error())
		}
		if scope, err = proxy.JWTScope(proxy.JWTConfig{Keys: jwks, Claim: *jwtClaim, Issuer: *jwtIssuer, Audience: *jwtAudience}); err != nil {
			return storeUsageError(stderr, fs, err.Error())
		}
	case *jwtClaim != "":
		return storeUsageError(stderr, fs, "--scope-jwt-claim needs --jwks-file: a claim is a scope only once the token's signature is verified")
	default:
		if scope, err = file.ProxyScope(); err != nil {
			return storeUsageError(stderr, fs, err.Error())
		}
	}

	opts := dbopen.Options{DB: *db, Keys: *keys, KeyTable: *table}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	h, err := dbopen.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "idem proxy: %v\n", err)
		return exitFailure
	}
	defer h.Close()
	if err := h.Migrate(ctx); err != nil {
		fmt.Fprintf(stderr, "idem proxy: %v\n", err)
		return exitFailure
	}
	reg := prometheus.NewRegistry()
	metrics, err := idemprom.New(reg, nil)
	if err != nil {
		fmt.Fprintf(stderr, "idem proxy: metrics: %v\n", err)
		return exitFailure
	}
	store := metrics.Store(h.Store)
	p, err := proxy.New(proxy.Config{
		Upstream: up, Store: store, Routes: rts, Scope: scope, RepeatSafe: *repeatSafe,
		UpstreamTimeout: *timeout, Observer: metrics,
	})
	if err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	janitor := &idem.Janitor{Store: h.Store, OnSweep: metrics.OnSweep}

	root := http.NewServeMux()
	root.Handle("GET /healthz", healthz(h.Store))
	root.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: proxyRoot(root, p), ReadHeaderTimeout: 10 * time.Second}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(stderr, "idem proxy: %v\n", err)
		return exitFailure
	}
	fmt.Fprintf(stdout, "idem proxy: listening on http://%s, forwarding to %s, keys in %s\n", ln.Addr(), up, h.KeysAt)
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	tick := time.NewTicker(time.Minute)
	defer tick.Stop()
	for {
		select {
		case err := <-errc:
			fmt.Fprintf(stderr, "idem proxy: %v\n", err)
			return exitFailure
		case <-tick.C:
			_, _ = janitor.Sweep(ctx)
		case <-ctx.Done():
			sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			err := srv.Shutdown(sctx)
			cancel()
			if err != nil && !errors.Is(err, context.DeadlineExceeded) {
				fmt.Fprintf(stderr, "idem proxy: shutdown: %v\n", err)
			}
			return exitOK
		}
	}
}

// proxyRoot serves /healthz and /metrics from root, everything else through p.
func proxyRoot(root *http.ServeMux, p http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodGet && (r.URL.Path == "/healthz" || r.URL.Path == "/metrics") {
			root.ServeHTTP(w, r)
			return
		}
		p.ServeHTTP(w, r)
	})
}

// healthz answers 200 when the key store answers a read within 2 s, 503 otherwise.
func healthz(store idem.Store) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		_, err := store.Get(ctx, "", "idem-proxy-healthz", time.Now())
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		if err != nil && !errors.Is(err, idem.ErrNotFound) {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintf(w, "key store unavailable: %v\n", err)
			return
		}
		fmt.Fprintln(w, "ok")
	})
}
