package idem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// ReplayedHeader is set to "true" on every replayed answer.
const ReplayedHeader = "Idempotent-Replayed"

// New returns middleware that makes the wrapped handler idempotent under the
// Idempotency-Key header, keeping records in store. A nil cfg means all defaults.
// It returns an error, saying what to change, when cfg is invalid.
//
// When store implements TxStore, every claimed request runs in a transaction that
// the handler reaches through the store package (for example sqlitestore.Tx), and
// the completion commits in it.
func New(store Store, cfg *Config) (func(http.Handler) http.Handler, error) {
	s, err := cfg.settings(store)
	if err != nil {
		return nil, err
	}
	m := &middleware{settings: s, store: store, sched: newScheduler(s.Lease, s.HandlerTimeout)}
	m.txStore, _ = store.(TxStore)
	m.singleTx, _ = store.(SingleTxStore)
	if c, ok := store.(ResponseCopier); ok {
		m.reuseResponses = c.CopiesResponses()
	}
	if s.InFlightWait > 0 {
		m.waits = newWaiters(m)
	}
	return func(next http.Handler) http.Handler {
		return &handler{middleware: m, next: next}
	}, nil
}

type middleware struct {
	*settings
	sched    *scheduler
	store    Store
	txStore  TxStore
	singleTx SingleTxStore
	// reuseResponses: the store copies what it keeps of a Response
	// (ResponseCopier), so their memory is pooled.
	reuseResponses bool
	// waits are the requests waiting for a holder's outcome; nil unless
	// Config.InFlightWait is set.
	waits *waiters
}

type handler struct {
	*middleware
	next http.Handler
}

// request is what the middleware knows about one keyed request. Everything the
// request needs lives in this one struct — the recorder, the replacement body, the
// handler's and the cleanup contexts, the lease renewal — so that a request costs
// one allocation of the middleware's own rather than one per part.
type request struct {
	h     *handler
	r     *http.Request
	scope string
	key   string
	body  []byte
	fp    string
	start time.Time

	bodyReader bodyReader
	rw         recorder
	exec       execContext
	cctx       cleanupContext
	spilled    bool      // the outcome was stored early and the response streamed
	claimed    bool      // the request holds the key: its next event ends the hold
	held       bool      // the request held the key at some point (InFlightWait: wake the waiters)
	waitUntil  time.Time // the end of its wait for a holder's outcome, once it waited

	claimCtx     cleanupContext // the claim's context (claimContext)
	claimCtxUsed bool           // claimCtx served a claim already

	renewal

	// own holds the default fingerprint (fp aliases it) and the claim's first
	// lock token in one small allocation instead of two. It is apart from the
	// request on purpose: a store that keeps either string (a Store of the
	// user's that holds ClaimRequest.Fingerprint in its record) pins these
	// 96 bytes, not the request with its recorder and buffered answer.
	own     *ownStrings
	tokUsed bool // own.tok holds a token
	// bodyBuf is the request's own memory for a small body (it is handed to
	// no store). A request is never reused, so nothing that aliases it sees
	// it change.
	bodyBuf [smallBody]byte
}

// ownStrings is the memory of a request's default fingerprint and first lock
// token (request.own).
type ownStrings struct {
	fp  [fingerprintV3Len]byte
	tok [tokenLen]byte
}

// smallBody is the longest body read into the request's own memory; with it
// a request (1272 bytes on 64-bit platforms, and the allocator's 8-byte header)
// fills the 1280-byte size class. A larger buffer would cost every request
// more memory than the body allocation it saves some.
const smallBody = 112

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.isKeyed(r.Method) {
		h.next.ServeHTTP(w, r)
		return
	}
	req := &request{h: h, r: r, start: h.NowFunc()}
	values := r.Header[h.HeaderName] // canonical (Config.check), as Values would look it up
	switch len(values) {
	case 0:
		if h.KeyOptional {
			h.next.ServeHTTP(w, r)
			return
		}
		h.reject(w, req, CodeKeyMissing, fmt.Sprintf("this endpoint requires an %s header; send one key, made once per operation (a UUID), with every retry of it", h.HeaderName))
		return
	case 1:
	default:
		h.reject(w, req, CodeKeyInvalid, fmt.Sprintf("%d %s header lines were sent; send exactly one", len(values), h.HeaderName))
		return
	}
	key, err := ParseKey(values[0], h.MaxKeyLength)
	if err != nil {
		h.reject(w, req, CodeKeyInvalid, err.Error())
		return
	}
	req.key = key
	req.body, err = req.readBody()
	if err != nil {
		if errors.Is(err, errBodyTooLarge) {
			h.reject(w, req, CodeBodyTooLarge, fmt.Sprintf("the request body is larger than %d bytes, the most this endpoint fingerprints", h.MaxRequestBody))
		} else {
			h.reject(w, req, CodeBodyUnreadable, "the request body could not be read: "+err.Error())
		}
		return
	}
	req.scope = StoredScope(h.ScopeFunc(r))
	if h.defaultFP {
		req.own = new(ownStrings)
		req.fp = fingerprintV3Into(&req.own.fp, r, req.body)
	} else {
		req.fp = h.FingerprintFunc(r, req.body)
	}
	if h.waits != nil {
		defer h.letGo(req)
	}
	if h.Flow == FlowSingleTx {
		h.serveSingleTx(w, req)
		return
	}
	h.serveClaim(w, req)
}

// isKeyed reports whether requests with method carry a key. Methods are matched
// without regard to case: a route registered without a method pattern runs its
// handler for "post" as for "POST", so both must be protected.
func (m *middleware) isKeyed(method string) bool {
	if m.keyed[method] {
		return true
	}
	for i := 0; i < len(method); i++ {
		if c := method[i]; 'a' <= c && c <= 'z' {
			return m.keyed[strings.ToUpper(method)]
		}
	}
	return false
}

var errBodyTooLarge = errors.New("body too large")

// preallocBody is the largest Content-Length for which the body's memory is
// taken in one piece before it is read.
const preallocBody = 1 << 20

// bodyReader replaces the request body after it was read for fingerprinting.
type bodyReader struct{ bytes.Reader }

func (*bodyReader) Close() error { return nil }

// readBody reads the request body for fingerprinting, at most MaxRequestBody
// bytes, and puts a reader over the same bytes in its place for the handler.
func (req *request) readBody() ([]byte, error) {
	r := req.r
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	max := req.h.MaxRequestBody
	if r.ContentLength > max {
		return nil, errBodyTooLarge
	}
	var body []byte
	var err error
	if r.ContentLength >= 0 && r.ContentLength <= preallocBody {
		if r.ContentLength <= smallBody {
			body = req.bodyBuf[:r.ContentLength:r.ContentLength]
		} else {
			body = make([]byte, r.ContentLength)
		}
		if _, err = io.ReadFull(r.Body, body); err == nil {
			// The server enforces ContentLength; a body that goes on is not ours to read.
			var one [1]byte
			if n, _ := r.Body.Read(one[:]); n > 0 {
				err = errors.New("the body is longer than its Content-Length")
			}
		}
	} else {
		// Read as it arrives: a large Content-Length is only a claim, and
		// memory for it is not taken before the bytes are there.
		limit := max
		if limit < math.MaxInt64 { // max+1 would wrap round and read nothing
			limit++
		}
		body, err = io.ReadAll(io.LimitReader(r.Body, limit))
		switch {
		case err != nil:
		case int64(len(body)) > max:
			err = errBodyTooLarge
		case r.ContentLength >= 0 && int64(len(body)) != r.ContentLength:
			err = fmt.Errorf("the body has %d bytes, not its Content-Length of %d", len(body), r.ContentLength)
		}
	}
	_ = r.Body.Close()
	if err != nil {
		return nil, err
	}
	req.bodyReader.Reset(body)
	r.Body = &req.bodyReader
	return body, nil
}

func (h *handler) inFlight(w http.ResponseWriter, req *request, left time.Duration) {
	// A lease is never renewed further than Lease ahead, so more than that left
	// means a clock that went back (or another server's clock ahead): the wait
	// is capped at the lease rather than told in hours.
	left = min(left, h.Lease)
	secs := max(1, ceilSeconds(left))
	h.problem(w, req, EventInFlight, nil, CodeKeyInUse, fmt.Sprintf("a request with this key is still being processed; retry after %d s with the same key and body", secs), secs)
}

// ceilSeconds is d in whole seconds, rounded up, without the overflow of
// (d + time.Second - 1) near the longest Duration.
func ceilSeconds(d time.Duration) int {
	secs := d / time.Second
	if d%time.Second > 0 {
		secs++
	}
	return int(secs)
}

// responseTooLarge answers a request whose transaction was rolled back because
// its response could not be kept.
func (h *handler) responseTooLarge(w http.ResponseWriter, req *request, size int, relErr error) {
	d := fmt.Sprintf("the response body (%d bytes) is larger than MaxStoredBody (%d) and could not be kept for replay, so nothing was committed; raise MaxStoredBody or configure a ReplayFunc", size, h.MaxStoredBody)
	if relErr != nil {
		d += " (the key could not be released: retries get 409 until its lease lapses)"
	}
	h.problem(w, req, EventReleased, relErr, CodeResponseTooLarge, d, 0)
}

func (h *handler) leaseLost(w http.ResponseWriter, req *request, err error) {
	h.problem(w, req, EventLeaseLost, err, CodeLeaseLost, "this request's lease lapsed and another request with the same key took over; nothing this request did was committed. Retry to get the outcome of the request that took over", 1)
}

func (h *handler) mismatch(w http.ResponseWriter, req *request, rec *Record) {
	h.problem(w, req, EventMismatch, nil, CodeKeyReused, fmt.Sprintf("this key was first used with a different request (a %s record); a key names one operation, so send a new key for a new request", rec.State), 0)
}

func (h *handler) storeFailed(w http.ResponseWriter, req *request, op string, err error) {
	if errors.Is(err, ErrFieldTooLarge) {
		// Not an outage: the store cannot keep this request's record (a custom
		// fingerprint longer than it indexes), and every retry would meet the
		// same limit.
		h.problem(w, req, EventStoreError, fmt.Errorf("%s: %w", op, err), CodeResponseTooLarge,
			"the idempotency store cannot keep this request's record ("+err.Error()+"), so the request was not executed; a retry would meet the same limit", 0)
		return
	}
	h.problem(w, req, EventStoreError, fmt.Errorf("%s: %w", op, err), CodeStoreUnavailable, "the idempotency store could not be reached, so the request was not executed; retry with the same key", 1)
}

func (h *handler) reject(w http.ResponseWriter, req *request, code, detail string) {
	h.problem(w, req, EventRejected, nil, code, detail, 0)
}

// otherRequest answers 422 idempotency_key_reused, instead of the handler's
// answer, to a request one of whose steps was recorded for another request
// with its key (ErrStepOtherRequest); the caller stored nothing and released
// the key (relErr: how that went).
func (h *handler) otherRequest(w http.ResponseWriter, req *request, rw *recorder, relErr error) {
	rw.discardHeaders()
	h.problem(w, req, EventMismatch, errors.Join(ErrStepOtherRequest, relErr), CodeKeyReused,
		"this key was first used with a different request, which did not finish and whose steps (calls to other services) are recorded under the key; this request was not run. A key names one operation: send a new key for a new request, or retry the first request as it was sent", 0)
}

func (h *handler) problem(w http.ResponseWriter, req *request, kind EventKind, err error, code, detail string, retryAfter int) {
	p := NewProblem(code, detail)
	WriteProblem(w, p, retryAfter)
	h.observe(req, Event{Kind: kind, Status: p.Status, Err: err})
}

// claimed marks req as holding its key, and tells an Observer that wants it.
func (h *handler) claimed(req *request) {
	if h.observeClaims {
		h.observe(req, Event{Kind: EventClaimed})
	}
	req.claimed, req.held = true, true
}

func (h *handler) observe(req *request, e Event) {
	if h.Observer == nil {
		return
	}
	e.Scope, e.Key = req.scope, req.key
	e.Claimed, req.claimed = req.claimed, false // one event ends the hold
	e.Took = h.NowFunc().Sub(req.start)
	h.Observer.Observe(req.r.Context(), e)
}

// recorder returns the request's recorder, writing to w.
func (req *request) recorder(w http.ResponseWriter) *recorder {
	req.rw = recorder{w: w, scope: req.scope, key: req.key, head: req.r.Method == http.MethodHead, req: req}
	req.rw.snapshotHeaders()
	return &req.rw
}

// freshCleanup returns the context for the store calls of the phase that starts
// now (after the handler, or a rollback before a takeover): it carries the
// request's values, does not end when the client goes away, and ends
// CleanupTimeout from now on the wall clock.
func (req *request) freshCleanup() context.Context {
	req.cctx.reset(req.r.Context(), req.h.CleanupTimeout)
	return &req.cctx
}

// freshCleanupAt is freshCleanup with wall, a wall clock reading, for now.
func (req *request) freshCleanupAt(wall time.Time) context.Context {
	req.cctx.resetAt(req.r.Context(), wall, req.h.CleanupTimeout)
	return &req.cctx
}

// releaseKey gives the key up so that the next request runs afresh. A record no
// longer in flight under token (taken over, or completed after all) is nothing
// to undo.
func (h *handler) releaseKey(ctx context.Context, req *request, token string) error {
	err := h.store.Release(ctx, req.scope, req.key, token)
	if errors.Is(err, ErrLockLost) {
		return nil
	}
	return err
}

// setContentLength sets Content-Length for bodies net/http would otherwise send
// chunked; for smaller ones net/http sets it itself, at no cost to us. A
// response with trailers stays chunked: with a Content-Length net/http drops
// them.
func setContentLength(h http.Header, n int) {
	if n >= 2048 && h.Get("Content-Length") == "" && !hasTrailers(h) {
		h.Set("Content-Length", strconv.Itoa(n))
	}
}

// hasTrailers reports whether h declares trailers, by a Trailer field or a
// key with http.TrailerPrefix.
func hasTrailers(h http.Header) bool {
	if len(h["Trailer"]) > 0 {
		return true
	}
	for k := range h {
		if strings.HasPrefix(k, http.TrailerPrefix) {
			return true
		}
	}
	return false
}
