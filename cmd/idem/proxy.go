package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
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

const proxyUsage = `Usage: idem proxy --upstream URL --db URL --scope-… [flags]

Forwards requests to the upstream; POST and PATCH (or the --route patterns)
carry an Idempotency-Key: one execution per key at the upstream, and every retry
gets the stored answer. Several routes: --config FILE (YAML; flags win over the
file). The data port is the upstream's alone: GET /healthz and GET /metrics
(Prometheus) are served on --admin-addr, when set.

A scope is required: --scope-header NAME (a gateway's tenant header),
--scope-bearer (API keys), --scope-jwt-claim CLAIM --jwks-file FILE, or
--scope none (every caller shares one key space: a warning says so).

The first output line, once the port is bound, is
"idem proxy: listening on http://HOST:PORT, …"; --ready-file FILE is written
then too. SIGINT or SIGTERM drains the requests in flight for up to
--upstream-timeout plus 11 s (a second signal stops at once; keys abandoned are
logged, and the exit status is 1). It also stops when the process that started
it exits (a killed go run), unless --exit-with-parent=false.

After an upstream (or proxy) died mid-request the outcome is unknown: retries
get 503 idempotency_outcome_unknown until you resolve the key with
idem resolve, unless --repeat-safe says the upstream may run it twice.

Example:
  idem proxy --listen 127.0.0.1:8081 --upstream http://127.0.0.1:3000 \
    --db sqlite:keys.db --route 'POST /orders' --scope-header X-Tenant-ID \
    --admin-addr 127.0.0.1:9081

Flags:
`

// Listener defaults of idem proxy.
const (
	proxyReadHeaderTimeout = 10 * time.Second
	proxyReadTimeout       = time.Minute
	proxyIdleTimeout       = 2 * time.Minute
	proxyParentPoll        = 500 * time.Millisecond
)

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
	ppid := os.Getppid()
	fs := flag.NewFlagSet("idem proxy", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:8081", "listen address; port 0 picks a free one (first output line: idem proxy: listening on http://HOST:PORT)")
	adminAddr := fs.String("admin-addr", "", "`host:port` serving GET /healthz and GET /metrics (Prometheus); empty (the default): not served")
	readyFile := fs.String("ready-file", "", "write the listening URL to this `file` once the port is bound (removed at exit)")
	upstream := fs.String("upstream", "", "the upstream's base URL, such as http://127.0.0.1:3000")
	db, keys, table := storeFlags(fs, "")
	config := fs.String("config", "", "a YAML file with routes, scope and the settings below")
	var routes, stored, trust multiFlag
	fs.Var(&routes, "route", "a keyed route, as a ServeMux pattern ('POST /orders', 'PATCH /orders/{id}'); repeatable; replaces the routes of --config; default: POST and PATCH on every path")
	keyOptional := fs.Bool("key-optional", false, "let keyed requests without a key through, unprotected (default: 400)")
	keyUnrouted := fs.Bool("key-unrouted", false, "strict mode: key a request that carries an Idempotency-Key but matches no --route (default: pass it through, counted and logged)")
	ttl := fs.Duration("ttl", 0, "how long outcomes are kept and replayed (default 24h)")
	lease := fs.Duration("lease", 0, "in-flight lease, renewed while the upstream works (default 30s)")
	inFlightWait := fs.Duration("in-flight-wait", 0, "how long a retry that finds its key still at the upstream waits for the outcome and gets the replay; 0: 409 idempotency_key_in_use at once")
	fs.Var(&stored, "stored-header", "a response header kept for replay; repeatable (default: idem's, Retry-After, WWW-Authenticate, CORS, Vary, Cache-Control; see docs/proxy.md)")
	var maxReq, maxStored sizeFlag
	fs.Var(&maxReq, "max-request-body", "largest request body buffered and fingerprinted, such as 1MiB (default 1MiB)")
	fs.Var(&maxStored, "max-stored-body", "largest response body kept for replay, such as 1MiB (default 1MiB)")
	scopeNone := fs.String("scope", "", "none: every caller shares one key space (a replay then skips the upstream's authentication); otherwise use a --scope-… flag")
	scopeHeader := fs.String("scope-header", "", "take the tenant from this request header (set by a gateway that authenticated the caller); Host keys by host name")
	scopeBearer := fs.Bool("scope-bearer", false, "the bearer token is the tenant (stored as its SHA-256): for long-lived API keys only, a refreshed OAuth token is another tenant")
	jwtClaim := fs.String("scope-jwt-claim", "", "take the tenant from this claim of a bearer JWT verified with --jwks-file")
	jwksFile := fs.String("jwks-file", "", "the JSON Web Key Set that verifies JWTs")
	jwtIssuer := fs.String("jwt-issuer", "", "the iss a JWT must have (needs --jwks-file)")
	jwtAudience := fs.String("jwt-audience", "", "an aud a JWT must have (needs --jwks-file)")
	jwtMaxAge := fs.Duration("jwt-max-token-age", 0, "the longest JWT lifetime accepted, exp minus iat (default 24h); tokens without exp are refused")
	releaseStatus := fs.String("release-status", "", "comma-separated 4xx/5xx statuses passed on without being kept, releasing the key (default 401,403,408,425,429)")
	release5xx := fs.Bool("release-5xx", false, "also pass every upstream 5xx on without keeping it (only for upstreams whose 5xx leaves no effects; default: kept and replayed like any answer)")
	repeatSafe := fs.Bool("repeat-safe", false, "the upstream may run an operation twice: after a lapsed lease, run it again instead of 503 idempotency_outcome_unknown")
	timeout := fs.Duration("upstream-timeout", 0, "bound on each keyed request's upstream call (default 30s); past it: 504 upstream_timeout, outcome unknown. Unkeyed requests are not bounded")
	idleTimeout := fs.Duration("upstream-idle-timeout", 0, "how long an idle upstream connection is kept for unkeyed requests (default 1s; keep it below the upstream's keep-alive timeout)")
	upstreamCA := fs.String("upstream-ca", "", "a PEM `file` of the CA certificates that sign an https upstream's certificate (default: the system's)")
	serverName := fs.String("upstream-server-name", "", "the name an https upstream's certificate must carry (default: the --upstream host)")
	upstreamProxy := fs.String("upstream-proxy", "", "a forward proxy `URL` to reach the upstream through (HTTP_PROXY and the like are ignored)")
	fs.Var(&trust, "trust-forwarded", "a CIDR (or address) of a gateway in front whose X-Forwarded-Proto, X-Forwarded-Host and Forwarded are passed on; repeatable, or comma-separated")
	preserveHost := fs.Bool("preserve-host", false, "send the client's Host upstream (default: the upstream's)")
	readHeaderTimeout := fs.Duration("read-header-timeout", proxyReadHeaderTimeout, "how long a client may take to send a request's headers")
	readTimeout := fs.Duration("read-timeout", proxyReadTimeout, "how long a client may take to send a whole keyed request, headers and body (unkeyed bodies stream); 0 for no bound")
	serverIdle := fs.Duration("idle-timeout", proxyIdleTimeout, "how long an idle client connection is kept open (above a load balancer's, such as 60s)")
	withParent := fs.Bool("exit-with-parent", true, "stop when the process that started the proxy exits (for example a killed go run); false for nohup and the like")
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
	pickDur := func(flagName string, flagVal *time.Duration, fileVal proxy.Duration) {
		if !set[flagName] && fileVal != 0 {
			*flagVal = time.Duration(fileVal)
		}
	}
	*listen = pick("listen", *listen, file.Listen)
	*adminAddr = pick("admin-addr", *adminAddr, file.AdminAddr)
	*upstream = pick("upstream", *upstream, file.Upstream)
	*db = pick("db", *db, file.DB)
	*keys = pick("keys", *keys, file.Keys)
	*table = pick("table", *table, file.Table)
	*upstreamCA = pick("upstream-ca", *upstreamCA, file.Path(file.UpstreamCA))
	*serverName = pick("upstream-server-name", *serverName, file.UpstreamServerName)
	*upstreamProxy = pick("upstream-proxy", *upstreamProxy, file.UpstreamProxy)
	if !set["repeat-safe"] {
		*repeatSafe = file.RepeatSafe
	}
	if !set["preserve-host"] {
		*preserveHost = file.PreserveHost
	}
	if !set["key-unrouted"] {
		*keyUnrouted = file.KeyUnrouted
	}
	if !set["trust-forwarded"] {
		trust = file.TrustForwarded
	}
	pickDur("upstream-timeout", timeout, file.UpstreamTimeout)
	pickDur("upstream-idle-timeout", idleTimeout, file.UpstreamIdleTimeout)
	pickDur("read-timeout", readTimeout, file.ReadTimeout)
	pickDur("idle-timeout", serverIdle, file.IdleTimeout)
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
	for _, a := range []struct{ name, addr string }{{"--listen", *listen}, {"--admin-addr", *adminAddr}} {
		if a.addr == "" && a.name == "--admin-addr" {
			continue
		}
		if msg := listenAddrProblem(a.name, a.addr); msg != "" {
			return storeUsageError(stderr, fs, msg)
		}
	}
	for name, d := range map[string]time.Duration{"--read-header-timeout": *readHeaderTimeout, "--read-timeout": *readTimeout, "--idle-timeout": *serverIdle, "--upstream-idle-timeout": *idleTimeout, "--upstream-timeout": *timeout, "--in-flight-wait": *inFlightWait} {
		if d < 0 {
			return storeUsageError(stderr, fs, fmt.Sprintf("%s %v is negative; use a positive duration such as 30s", name, d))
		}
	}

	rts, err := file.ProxyRoutes()
	if err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	if len(routes) > 0 {
		if len(rts) > 0 {
			fmt.Fprintf(stderr, "idem proxy: warning: --route replaces the %d route(s) of %s, with their settings\n", len(rts), *config)
		}
		rts = nil
		for _, p := range routes {
			rts = append(rts, proxy.Route{Pattern: p})
		}
	}
	if len(rts) == 0 {
		rts = append(rts, proxy.DefaultRoutes...)
	}
	var release []int
	if set["release-status"] {
		release = []int{}
		for _, f := range strings.Split(*releaseStatus, ",") {
			if f = strings.TrimSpace(f); f == "" {
				continue
			}
			n, err := strconv.Atoi(f)
			if err != nil || n < 400 || n > 599 {
				return storeUsageError(stderr, fs, fmt.Sprintf("--release-status %q: %q is not a 4xx or 5xx status; write for example 408,425,429,503", *releaseStatus, f))
			}
			release = append(release, n)
		}
	}
	for i := range rts { // flags apply to every route
		r := &rts[i]
		r.KeyOptional = r.KeyOptional || *keyOptional
		r.Release5xx = r.Release5xx || *release5xx
		if release != nil {
			r.ReleaseStatus = release
		}
		if set["ttl"] {
			r.TTL = *ttl
		}
		if set["lease"] {
			r.Lease = *lease
		}
		if set["in-flight-wait"] {
			r.InFlightWait = *inFlightWait
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

	scope, scopeDesc, msg := proxyScope(file, *scopeNone, *scopeHeader, *scopeBearer, *jwtClaim, *jwksFile, *jwtIssuer, *jwtAudience, *jwtMaxAge)
	if msg != "" {
		return storeUsageError(stderr, fs, msg)
	}

	var prefixes []netip.Prefix
	for _, list := range trust {
		for _, c := range strings.Split(list, ",") {
			if strings.TrimSpace(c) == "" {
				continue
			}
			p, err := proxy.ParsePrefix(c)
			if err != nil {
				return storeUsageError(stderr, fs, "--trust-forwarded: "+err.Error())
			}
			prefixes = append(prefixes, p)
		}
	}
	var tlsCfg *tls.Config
	if *upstreamCA != "" || *serverName != "" {
		tlsCfg = &tls.Config{ServerName: *serverName}
		if *upstreamCA != "" {
			pem, err := os.ReadFile(*upstreamCA)
			if err != nil {
				return storeUsageError(stderr, fs, "--upstream-ca: "+err.Error())
			}
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(pem) {
				return storeUsageError(stderr, fs, fmt.Sprintf("--upstream-ca %s holds no PEM certificate (-----BEGIN CERTIFICATE-----)", *upstreamCA))
			}
			tlsCfg.RootCAs = pool
		}
	}
	var fwd *url.URL
	if *upstreamProxy != "" {
		if fwd, err = url.Parse(*upstreamProxy); err != nil || fwd.Host == "" {
			return storeUsageError(stderr, fs, fmt.Sprintf("--upstream-proxy %q is not a URL such as http://proxy.internal:3128", *upstreamProxy))
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
	unrouted := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "idem_proxy_unrouted_keyed_requests_total",
		Help: "Requests that carried an Idempotency-Key but matched no keyed route (keyed anyway with --key-unrouted).",
	})
	reg.MustRegister(unrouted)
	store := metrics.Store(h.Store)
	p, err := proxy.New(proxy.Config{
		Upstream: up, Store: store, Routes: rts, Scope: scope, RepeatSafe: *repeatSafe,
		UpstreamTimeout: *timeout, UpstreamIdleTimeout: *idleTimeout, UpstreamTLS: tlsCfg, UpstreamProxy: fwd,
		TrustForwarded: prefixes, PreserveHost: *preserveHost, KeyUnrouted: *keyUnrouted,
		OnUnrouted: func(string, string) { unrouted.Inc() }, Observer: metrics,
	})
	if err != nil {
		// The library's error reads "proxy: route N (…): idem: invalid config: …";
		// after this command's "idem proxy: " prefix only the route and the
		// finding are news, named by the flags that set them.
		msg := strings.TrimPrefix(err.Error(), "proxy: ")
		msg = strings.Replace(msg, "idem: invalid config: ", "", 1)
		msg = strings.NewReplacer("invalid InFlightWait", "invalid --in-flight-wait", "invalid Lease", "invalid --lease", "invalid TTL", "invalid --ttl", "than Lease", "than --lease", "than TTL", "than --ttl").Replace(msg)
		return storeUsageError(stderr, fs, msg)
	}
	janitor := &idem.Janitor{Store: h.Store, OnSweep: metrics.OnSweep}

	srv := &http.Server{Handler: p, ReadHeaderTimeout: *readHeaderTimeout, ReadTimeout: *readTimeout, IdleTimeout: *serverIdle}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintf(stderr, "idem proxy: %v\n", err)
		return exitFailure
	}
	var admin *http.Server
	var aln net.Listener
	if *adminAddr != "" {
		if aln, err = net.Listen("tcp", *adminAddr); err != nil {
			_ = ln.Close()
			fmt.Fprintf(stderr, "idem proxy: --admin-addr: %v; pick another address, or leave it empty\n", err)
			return exitFailure
		}
		mux := http.NewServeMux()
		mux.Handle("GET /healthz", healthz(h.Store))
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		admin = &http.Server{Handler: mux, ReadHeaderTimeout: proxyReadHeaderTimeout, ReadTimeout: proxyReadTimeout, WriteTimeout: proxyReadTimeout, IdleTimeout: proxyIdleTimeout}
	}
	fmt.Fprintf(stdout, "idem proxy: listening on http://%s, forwarding to %s, keys in %s\n", ln.Addr(), up.Redacted(), h.KeysAt)
	if admin != nil {
		fmt.Fprintf(stdout, "idem proxy: GET /healthz and GET /metrics on http://%s\n", aln.Addr())
	} else {
		fmt.Fprintln(stdout, "idem proxy: no /healthz or /metrics (set --admin-addr to serve them)")
	}
	var rl []string
	for _, r := range rts {
		d := r.Pattern
		if r.KeyOptional {
			d += " (key optional)"
		}
		rl = append(rl, d)
	}
	fmt.Fprintf(stdout, "idem proxy: keyed routes: %s; scope: %s\n", strings.Join(rl, ", "), scopeDesc)
	if scopeDesc == "none" {
		fmt.Fprintln(stderr, "idem proxy: WARNING: --scope none: every caller shares one key space, and a retry with another caller's key and body gets that caller's stored answer without the upstream checking its credentials")
	}
	if *readyFile != "" {
		if err := writeReadyFile(*readyFile, "http://"+ln.Addr().String()); err != nil {
			_ = ln.Close()
			fmt.Fprintf(stderr, "idem proxy: --ready-file: %v\n", err)
			return exitFailure
		}
		defer os.Remove(*readyFile)
	}

	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	if *withParent {
		go proxyWatchParent(ctx, ppid, stop)
	}
	errc := make(chan error, 2)
	go func() { errc <- srv.Serve(ln) }()
	if admin != nil {
		go func() { errc <- admin.Serve(aln) }()
	}
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
			return proxyDrain(srv, admin, p, context.Cause(ctx), stderr)
		}
	}
}

// proxyScope builds the scope the flags (or the file) give, with its
// description for the banner, or a usage error.
func proxyScope(file *proxy.File, none, header string, bearer bool, claim, jwks, issuer, audience string, maxAge time.Duration) (proxy.Scope, string, string) {
	if none != "" && none != "none" {
		return nil, "", fmt.Sprintf("--scope %q: the only value is none; take the tenant from --scope-header, --scope-bearer or --scope-jwt-claim", none)
	}
	sources := 0
	for _, on := range []bool{none != "", header != "", bearer, claim != "" || jwks != ""} {
		if on {
			sources++
		}
	}
	if jwks == "" && (issuer != "" || audience != "" || maxAge != 0) {
		return nil, "", "--jwt-issuer, --jwt-audience and --jwt-max-token-age need --scope-jwt-claim with --jwks-file: without a key set no token is verified"
	}
	switch {
	case sources > 1:
		return nil, "", "give one scope source: --scope-header, --scope-bearer, --scope-jwt-claim with --jwks-file, or --scope none"
	case none != "":
		return proxy.NoScope(), "none", ""
	case header != "":
		if err := proxy.CheckScopeHeader(header); err != nil {
			return nil, "", "--scope-header: " + err.Error()
		}
		return proxy.HeaderScope(header), "header " + http.CanonicalHeaderKey(header), ""
	case bearer:
		return proxy.BearerScope(), "bearer token (SHA-256)", ""
	case jwks != "":
		set, err := proxy.LoadJWKS(jwks)
		if err != nil {
			return nil, "", "--jwks-file: " + err.Error()
		}
		s, err := proxy.JWTScope(proxy.JWTConfig{Keys: set, Claim: claim, Issuer: issuer, Audience: audience, MaxTokenAge: maxAge})
		if err != nil {
			return nil, "", err.Error()
		}
		if claim == "" {
			claim = "sub"
		}
		return s, "JWT claim " + claim, ""
	case claim != "":
		return nil, "", "--scope-jwt-claim needs --jwks-file: a claim is a scope only once the token's signature is verified"
	}
	s, err := file.ProxyScope()
	if err != nil {
		return nil, "", err.Error()
	}
	if s == nil {
		return nil, "", "a scope is required: --scope-header X-Tenant-ID (a gateway's tenant header), --scope-bearer (API keys), --scope-jwt-claim CLAIM --jwks-file FILE, or --scope none (every caller shares one key space)"
	}
	switch fsc := file.Scope; {
	case fsc.None:
		return s, "none", ""
	case fsc.Header != "":
		return s, "header " + http.CanonicalHeaderKey(fsc.Header), ""
	case fsc.Bearer:
		return s, "bearer token (SHA-256)", ""
	}
	return s, "JWT", ""
}

// writeReadyFile writes content to path atomically: a reader sees all of it
// or no file.
func writeReadyFile(path, content string) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".idem-proxy-ready-*")
	if err != nil {
		return err
	}
	if _, err := tmp.WriteString(content + "\n"); err != nil {
		_ = tmp.Close()
		_ = os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		_ = os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// errProxyParentExited is the cause of the proxy's stop when the process
// that started it exits.
var errProxyParentExited = errors.New("the process that started the proxy exited")

// proxyWatchParent stops the proxy when its parent process changes from ppid
// (an orphan is re-parented); with ppid 1 there is nothing to watch.
func proxyWatchParent(ctx context.Context, ppid int, stop context.CancelCauseFunc) {
	if ppid <= 1 {
		return
	}
	t := time.NewTicker(proxyParentPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if os.Getppid() != ppid {
				stop(fmt.Errorf("%w (pid %d)", errProxyParentExited, ppid))
				return
			}
		}
	}
}

// proxyDrain shuts the servers down: requests in flight get p.DrainTimeout()
// to finish, a second SIGINT or SIGTERM ends the wait. Keys still at the
// upstream then are logged, and the exit status is 1.
func proxyDrain(srv, admin *http.Server, p *proxy.Proxy, cause error, stderr io.Writer) int {
	why := "interrupted (SIGINT or SIGTERM)"
	if errors.Is(cause, errProxyParentExited) {
		why = cause.Error()
	}
	drain := p.DrainTimeout()
	fmt.Fprintf(stderr, "idem proxy: stopping: %s; waiting up to %v for requests in flight (a second SIGINT or SIGTERM stops at once)\n", why, drain)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sig)
	sctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	go func() {
		select {
		case <-sig:
			cancel()
		case <-sctx.Done():
		}
	}()
	if admin != nil {
		defer admin.Close()
	}
	if err := srv.Shutdown(sctx); err == nil {
		fmt.Fprintln(stderr, "idem proxy: stopped")
		return exitOK
	}
	abandoned := p.InFlight()
	_ = srv.Close()
	for _, a := range abandoned {
		fmt.Fprintf(stderr, "idem proxy: abandoned key %q (scope %q, %s %s, at the upstream for %v): its outcome is unknown; look at the upstream, then idem resolve it\n",
			a.Key, a.Scope, a.Method, a.Path, time.Since(a.Since).Round(time.Millisecond))
	}
	if len(abandoned) > 0 {
		fmt.Fprintf(stderr, "idem proxy: stopped with %d key(s) abandoned\n", len(abandoned))
		return exitFailure
	}
	fmt.Fprintln(stderr, "idem proxy: stopped")
	return exitOK
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
