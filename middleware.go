package idem

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"sync"
	"time"
)

// ReplayedHeader is set to "true" on every replayed answer.
const ReplayedHeader = "Idempotent-Replayed"

// replayedTrue is the value of ReplayedHeader, shared by every replay (net/http
// only reads header values).
var replayedTrue = []string{"true"}

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
	m := &middleware{settings: s, store: store}
	m.txStore, _ = store.(TxStore)
	m.singleTx, _ = store.(SingleTxStore)
	return func(next http.Handler) http.Handler {
		return &handler{middleware: m, next: next}
	}, nil
}

type middleware struct {
	*settings
	store    Store
	txStore  TxStore
	singleTx SingleTxStore
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
	hctx       handlerContext
	cctx       cleanupContext
	cctxUsed   bool
	renewal
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.keyed[r.Method] {
		h.next.ServeHTTP(w, r)
		return
	}
	req := &request{h: h, r: r, start: h.NowFunc()}
	values := r.Header.Values(h.HeaderName)
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
	req.scope = h.ScopeFunc(r)
	req.fp = h.FingerprintFunc(r, req.body)
	if h.Flow == FlowSingleTx {
		h.serveSingleTx(w, req)
		return
	}
	h.serveClaim(w, req)
}

var errBodyTooLarge = errors.New("body too large")

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
	if r.ContentLength >= 0 {
		body = make([]byte, r.ContentLength)
		if _, err = io.ReadFull(r.Body, body); err == nil {
			// The server enforces ContentLength; a body that goes on is not ours to read.
			var one [1]byte
			if n, _ := r.Body.Read(one[:]); n > 0 {
				err = errors.New("the body is longer than its Content-Length")
			}
		}
	} else {
		body, err = io.ReadAll(io.LimitReader(r.Body, max+1))
		if err == nil && int64(len(body)) > max {
			err = errBodyTooLarge
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

func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// serveClaim is the claim-then-complete flow.
func (h *handler) serveClaim(w http.ResponseWriter, req *request) {
	ctx := req.r.Context()
	now := h.NowFunc()
	claim := ClaimRequest{
		Scope: req.scope, Key: req.key, Fingerprint: req.fp, Token: newToken(),
		Now: now, LeaseUntil: now.Add(h.Lease), ExpiresAt: now.Add(h.TTL),
	}
	rec, claimed, err := h.store.Claim(ctx, claim)
	if err != nil {
		h.storeFailed(w, req, "claim", err)
		return
	}
	if !claimed {
		match, legacy := sameRequest(req.fp, rec.Fingerprint, req.r, req.body)
		if !match {
			h.mismatch(w, req, rec)
			return
		}
		if rec.State == StateComplete {
			h.replay(w, req, rec)
			return
		}
		if legacy != "" && !rec.LeaseUntil.After(now) {
			// A lapsed claim written under an older fingerprint version: claim it
			// with the fingerprint it was stored under.
			claim.Fingerprint = legacy
			rec, claimed, err = h.store.Claim(ctx, claim)
			if err != nil {
				h.storeFailed(w, req, "claim", err)
				return
			}
		}
		if !claimed {
			if rec.State == StateComplete {
				h.replay(w, req, rec)
				return
			}
			h.inFlight(w, req, rec.LeaseUntil.Sub(now))
			return
		}
	}
	if now.Sub(rec.CreatedAt) > time.Millisecond { // a takeover keeps the first claim's CreatedAt; stores may round to milliseconds
		h.observe(req, Event{Kind: EventTakenOver})
	}
	h.execute(w, req, claim.Token)
}

// execute runs the handler of a claimed request and settles its outcome.
func (h *handler) execute(w http.ResponseWriter, req *request, token string) {
	r := req.r
	rw := req.recorder(w)
	cancelCtx, cancel := context.WithCancelCause(r.Context())
	defer cancel(nil)
	req.hctx = handlerContext{Context: cancelCtx, rw: rw}
	var ctx context.Context = &req.hctx
	var tx Tx
	if h.txStore != nil {
		var err error
		ctx, tx, err = h.txStore.BeginTx(ctx)
		if err != nil {
			h.release(req, token)
			h.storeFailed(w, req, "begin transaction", err)
			return
		}
	}
	req.startRenewal(token, cancel)
	settled := false
	defer func() {
		if settled {
			return
		}
		// The handler panicked: leave nothing behind, then let the panic go on.
		req.stopRenewal()
		if tx != nil {
			_ = tx.Rollback(req.cleanupContext())
		}
		h.release(req, token)
		req.cctx.stop()
	}()
	h.next.ServeHTTP(rw, r.WithContext(ctx))
	settled = true
	req.stopRenewal()

	cctx := req.cleanupContext()
	defer req.cctx.stop()
	status := rw.statusOrOK()
	if !h.KeepFunc(status) {
		if tx != nil {
			_ = tx.Rollback(cctx)
		}
		h.release(req, token)
		rw.send()
		return
	}
	resp := &Response{Status: status, Header: h.storedHeader(w.Header()), Ref: rw.ref}
	tooLarge := rw.body.Len() > h.MaxStoredBody
	switch {
	case h.ReplayFunc != nil || tooLarge:
		resp.BodyOmitted = true
	default:
		resp.Body = rw.body.Bytes()
	}
	if tx == nil {
		now := h.NowFunc()
		err := h.store.Complete(cctx, req.scope, req.key, token, resp, now, now.Add(h.TTL))
		switch {
		case errors.Is(err, ErrLockLost):
			// The handler's effects happened; the client hears what they were.
			h.observe(req, Event{Kind: EventLeaseLost, Status: status, Err: err})
		case err != nil:
			h.observe(req, Event{Kind: EventStoreError, Status: status, Err: fmt.Errorf("complete: %w", err)})
		default:
			h.observe(req, Event{Kind: EventExecuted, Status: status})
		}
		rw.send()
		return
	}
	if tooLarge && h.ReplayFunc == nil {
		_ = tx.Rollback(cctx)
		h.release(req, token)
		rw.discardHeaders()
		h.responseTooLarge(w, req, rw.body.Len())
		return
	}
	now := h.NowFunc()
	if err := tx.Complete(cctx, req.scope, req.key, token, resp, now, now.Add(h.TTL)); err != nil {
		_ = tx.Rollback(cctx)
		rw.discardHeaders()
		if errors.Is(err, ErrLockLost) || errors.Is(context.Cause(ctx), ErrLockLost) {
			h.leaseLost(w, req, err)
			return
		}
		h.release(req, token)
		h.storeFailed(w, req, "complete", err)
		return
	}
	if err := tx.Commit(cctx); err != nil {
		_ = tx.Rollback(cctx)
		rw.discardHeaders()
		if errors.Is(err, ErrLockLost) { // a store that checks the fence as part of the commit
			h.leaseLost(w, req, err)
			return
		}
		h.release(req, token)
		h.problem(w, req, EventStoreError, err, CodeCommitFailed, "the transaction could not be committed, so nothing was stored and the key was released; retry with the same key", 1)
		return
	}
	h.observe(req, Event{Kind: EventExecuted, Status: status})
	rw.send()
}

// serveSingleTx is the single-transaction flow.
func (h *handler) serveSingleTx(w http.ResponseWriter, req *request) {
	r := req.r
	now := h.NowFunc()
	rw := req.recorder(w)
	// Not req.hctx: a driver may still watch this context after the transaction
	// ended, and a takeover below hands req.hctx to the claim-then-complete flow.
	ctx, tx, rec, err := h.singleTx.BeginLocked(&handlerContext{Context: r.Context(), rw: rw}, req.scope, req.key, now)
	if errors.Is(err, ErrInFlight) {
		h.inFlight(w, req, 0)
		return
	}
	if err != nil {
		h.storeFailed(w, req, "begin locked transaction", err)
		return
	}
	defer req.cctx.stop()
	if rec != nil {
		_ = tx.Rollback(req.cleanupContext())
		switch match, _ := sameRequest(req.fp, rec.Fingerprint, r, req.body); {
		case !match:
			h.mismatch(w, req, rec)
		case rec.State == StateComplete:
			h.replay(w, req, rec)
		case !rec.LeaseUntil.After(now):
			// An in-flight record whose holder crashed: a claim-then-complete request
			// with this key (before the route switched flows, or from another
			// route). Take it over through the fenced claim, as that flow would,
			// rather than answer 409 until the record expires.
			h.serveClaim(w, req)
		default:
			h.inFlight(w, req, rec.LeaseUntil.Sub(now))
		}
		return
	}
	settled := false
	defer func() {
		if !settled {
			_ = tx.Rollback(req.cleanupContext())
		}
	}()
	h.next.ServeHTTP(rw, r.WithContext(ctx))
	settled = true

	cctx := req.cleanupContext()
	status := rw.statusOrOK()
	if !h.KeepFunc(status) {
		_ = tx.Rollback(cctx)
		rw.send()
		return
	}
	if rw.body.Len() > h.MaxStoredBody && h.ReplayFunc == nil {
		_ = tx.Rollback(cctx)
		rw.discardHeaders()
		h.responseTooLarge(w, req, rw.body.Len())
		return
	}
	done := h.NowFunc()
	resp := &Response{Status: status, Header: h.storedHeader(w.Header()), Ref: rw.ref}
	if h.ReplayFunc != nil {
		resp.BodyOmitted = true
	} else {
		resp.Body = rw.body.Bytes()
	}
	rec = &Record{
		Scope: req.scope, Key: req.key, State: StateComplete, Fingerprint: req.fp,
		Token: newToken(), CreatedAt: now, LeaseUntil: done, ExpiresAt: done.Add(h.TTL), Response: resp,
	}
	if err := tx.Insert(cctx, rec); err != nil {
		_ = tx.Rollback(cctx)
		rw.discardHeaders()
		if errors.Is(err, ErrInFlight) {
			h.inFlight(w, req, 0)
			return
		}
		h.storeFailed(w, req, "insert record", err)
		return
	}
	if err := tx.Commit(cctx); err != nil {
		_ = tx.Rollback(cctx) // frees the lock of a store that did not on a failed commit
		rw.discardHeaders()
		if errors.Is(err, ErrInFlight) { // a store that writes the record as part of the commit
			h.inFlight(w, req, 0)
			return
		}
		h.problem(w, req, EventStoreError, err, CodeCommitFailed, "the transaction could not be committed, so nothing was stored; retry with the same key", 1)
		return
	}
	h.observe(req, Event{Kind: EventExecuted, Status: status})
	rw.send()
}

// storedHeader copies the allow-listed headers out of h.
func (h *handler) storedHeader(src http.Header) http.Header {
	var out http.Header
	for _, name := range h.storedHdrs {
		if v, ok := src[name]; ok {
			if out == nil {
				out = make(http.Header, len(h.storedHdrs))
			}
			out[name] = v // the handler is done with its header map; the values are not changed after this
		}
	}
	return out
}

// replay answers with the stored outcome of rec.
func (h *handler) replay(w http.ResponseWriter, req *request, rec *Record) {
	resp := rec.Response
	if resp == nil {
		h.storeFailed(w, req, "replay", fmt.Errorf("the store returned a complete record for key %q without a response", req.key))
		return
	}
	hdr := w.Header()
	if resp.BodyOmitted {
		if h.ReplayFunc == nil {
			h.problem(w, req, EventReplayed, nil, CodeResponseTooLarge, fmt.Sprintf("the operation already completed with status %d, but its response was not kept (larger than MaxStoredBody, or stored as a reference without a ReplayFunc); it cannot be replayed", resp.Status), 0)
			return
		}
		rw := req.recorder(w)
		if err := h.ReplayFunc(rw, req.r, rec); err != nil {
			rw.discardHeaders()
			h.problem(w, req, EventReplayed, err, CodeReplayFailed, "the operation already completed, but its answer could not be rebuilt: "+err.Error(), 0)
			return
		}
		hdr.Set(ReplayedHeader, "true")
		h.observe(req, Event{Kind: EventReplayed, Status: rw.statusOrOK()})
		rw.send()
		return
	}
	for k, v := range resp.Header {
		hdr[k] = v
	}
	hdr[ReplayedHeader] = replayedTrue
	setContentLength(hdr, len(resp.Body))
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
	h.observe(req, Event{Kind: EventReplayed, Status: resp.Status})
}

func (h *handler) inFlight(w http.ResponseWriter, req *request, left time.Duration) {
	secs := int((left + time.Second - 1) / time.Second)
	if secs < 1 {
		secs = 1
	}
	h.problem(w, req, EventInFlight, nil, CodeKeyInUse, fmt.Sprintf("a request with this key is still being processed; retry after %d s with the same key and body", secs), secs)
}

// responseTooLarge answers a request whose transaction was rolled back because
// its response could not be kept.
func (h *handler) responseTooLarge(w http.ResponseWriter, req *request, size int) {
	h.problem(w, req, EventReleased, nil, CodeResponseTooLarge, fmt.Sprintf("the response body (%d bytes) is larger than MaxStoredBody (%d) and could not be kept for replay, so nothing was committed; raise MaxStoredBody or configure a ReplayFunc", size, h.MaxStoredBody), 0)
}

func (h *handler) leaseLost(w http.ResponseWriter, req *request, err error) {
	h.problem(w, req, EventLeaseLost, err, CodeLeaseLost, "this request's lease lapsed and another request with the same key took over; nothing this request did was committed. Retry to get the outcome of the request that took over", 1)
}

func (h *handler) mismatch(w http.ResponseWriter, req *request, rec *Record) {
	h.problem(w, req, EventMismatch, nil, CodeKeyReused, fmt.Sprintf("this key was first used with a different request (a %s record); a key names one operation, so send a new key for a new request", rec.State), 0)
}

func (h *handler) storeFailed(w http.ResponseWriter, req *request, op string, err error) {
	h.problem(w, req, EventStoreError, fmt.Errorf("%s: %w", op, err), CodeStoreUnavailable, "the idempotency store could not be reached, so the request was not executed; retry with the same key", 1)
}

func (h *handler) reject(w http.ResponseWriter, req *request, code, detail string) {
	h.problem(w, req, EventRejected, nil, code, detail, 0)
}

func (h *handler) problem(w http.ResponseWriter, req *request, kind EventKind, err error, code, detail string, retryAfter int) {
	p := NewProblem(code, detail)
	WriteProblem(w, p, retryAfter)
	h.observe(req, Event{Kind: kind, Status: p.Status, Err: err})
}

func (h *handler) observe(req *request, e Event) {
	if h.Observer == nil {
		return
	}
	e.Scope, e.Key = req.scope, req.key
	e.Took = h.NowFunc().Sub(req.start)
	h.Observer.Observe(req.r.Context(), e)
}

// recorder returns the request's recorder, writing to w.
func (req *request) recorder(w http.ResponseWriter) *recorder {
	req.rw = recorder{w: w, scope: req.scope, key: req.key}
	return &req.rw
}

// cleanupContext returns the context for store calls after the handler: it
// carries the request's values but does not end when the client goes away, only
// CleanupTimeout after its first use.
func (req *request) cleanupContext() context.Context {
	if !req.cctxUsed {
		req.cctxUsed = true
		req.cctx.init(req.r.Context(), req.h.NowFunc().Add(req.h.CleanupTimeout))
	}
	return &req.cctx
}

// release gives the key up so that the next request runs afresh.
func (h *handler) release(req *request, token string) {
	err := h.store.Release(req.cleanupContext(), req.scope, req.key, token)
	if errors.Is(err, ErrLockLost) {
		err = nil // someone took over, or the commit went through after all: nothing to undo
	}
	h.observe(req, Event{Kind: EventReleased, Err: err})
}

// renewal extends a claim's lease every Lease/3 while its handler runs, and
// cancels the handler's context when the lease turns out to be lost. Transient
// store errors are not a lost lease: renewal keeps trying, and the fenced
// completion has the last word. It is embedded in request.
type renewal struct {
	token  string
	cancel context.CancelCauseFunc
	mu     sync.Mutex
	done   bool
	timer  *time.Timer
}

func (req *request) startRenewal(token string, cancel context.CancelCauseFunc) {
	req.mu.Lock() // renew reads req.timer
	defer req.mu.Unlock()
	req.token, req.cancel = token, cancel
	req.timer = time.AfterFunc(req.h.Lease/3, req.renew)
}

func (req *request) renew() {
	req.mu.Lock()
	if req.done {
		req.mu.Unlock()
		return
	}
	req.mu.Unlock()
	h := req.h
	ctx, cancel := context.WithTimeout(context.WithoutCancel(req.r.Context()), h.Lease/3)
	now := h.NowFunc()
	err := h.store.Extend(ctx, req.scope, req.key, req.token, now, now.Add(h.Lease))
	cancel()
	req.mu.Lock()
	defer req.mu.Unlock()
	if req.done {
		return
	}
	if errors.Is(err, ErrLockLost) {
		req.done = true
		req.cancel(ErrLockLost)
		h.observe(req, Event{Kind: EventLeaseLost, Err: err})
		return
	}
	req.timer.Reset(h.Lease / 3)
}

func (req *request) stopRenewal() {
	req.mu.Lock()
	req.done = true
	req.mu.Unlock()
	req.timer.Stop()
}

// setContentLength sets Content-Length for bodies net/http would otherwise send
// chunked; for smaller ones net/http sets it itself, at no cost to us.
func setContentLength(h http.Header, n int) {
	if n >= 2048 && h.Get("Content-Length") == "" {
		h.Set("Content-Length", strconv.Itoa(n))
	}
}
