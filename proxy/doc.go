// Package proxy is a reverse proxy that gives any upstream HTTP API the server
// half of the Idempotency-Key contract, without a change to the upstream: it is
// what `idem proxy` runs, and it can be embedded in a Go program of your own.
//
// It is net/http/httputil.ReverseProxy behind the idem middleware and an idem
// store, one middleware per configured route: the same state machine as a Go
// service using idem.New, with the upstream call as the handler.
//
//	store := memstore.New(nil) // or a SQL or Redis store shared by every proxy instance
//	p, err := proxy.New(proxy.Config{
//		Upstream: upstreamURL,
//		Store:    store,
//		Routes:   []proxy.Route{{Pattern: "POST /orders"}},
//		Scope:    proxy.HeaderScope("X-Tenant-ID"),
//	})
//	http.ListenAndServe("127.0.0.1:8081", p)
//
// What the proxy guarantees: at most one request per (scope, key) is at the
// upstream at a time, and a completed outcome is replayed, byte for byte, to
// every retry. What it cannot do is share the upstream's transaction: when the
// upstream, or the proxy, dies while a request is at the upstream, whether the
// operation took effect is unknown. The record then stays in flight until its
// lease lapses, and Config.RepeatSafe decides what a retry gets after that: a
// second execution (only when the upstream is safe to repeat), or, by default,
// 503 idempotency_outcome_unknown until an operator resolves the key with
// `idem resolve`.
//
// A keyed request goes upstream on a new connection, with the Content-Length
// of the body it was fingerprinted by. Upstream failures are answered with
// problems of the proxy's own (see the Code constants): a request that did not
// reach the upstream (502 upstream_unreachable, the key released: the
// connection or its TLS handshake failed, or not a byte was written), one that
// fails mid-request (502 upstream_failed, outcome unknown) and one that does
// not answer within Config.UpstreamTimeout (504 upstream_timeout, outcome
// unknown). "Not now" answers (Route.ReleaseStatus: 401, 403, 408, 425, 429 by
// default) are passed on without being kept.
//
// Routes match loosely (method and path case, a trailing slash, ";" segment
// parameters), so that a route protects what a loose upstream router sends to
// its handler; a request with a key that matches no route is reported
// (Config.OnUnrouted), or keyed anyway (Config.KeyUnrouted).
package proxy
