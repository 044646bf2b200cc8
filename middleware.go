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

// request is what the middleware knows about one keyed request.
type request struct {
	r     *http.Request
	scope string
	key   string
	body  []byte
	fp    string
	start time.Time
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.keyed[r.Method] {
		h.next.ServeHTTP(w, r)
		return
	}
	req := request{r: r, start: h.NowFunc()}
	values := r.Header.Values(h.HeaderName)
	switch len(values) {
	case 0:
		if h.KeyOptional {
			h.next.ServeHTTP(w, r)
			return
		}
		h.reject(w, &req, CodeKeyMissing, fmt.Sprintf("this endpoint requires an %s header; send one key, made once per operation (a UUID), with every retry of it", h.HeaderName))
		return
	case 1:
	default:
		h.reject(w, &req, CodeKeyInvalid, fmt.Sprintf("%d %s header lines were sent; send exactly one", len(values), h.HeaderName))
		return
	}
	key, err := ParseKey(values[0], h.MaxKeyLength)
	if err != nil {
		h.reject(w, &req, CodeKeyInvalid, err.Error())
		return
	}
	req.key = key
	req.body, err = h.readBody(r)
	if err != nil {
		if errors.Is(err, errBodyTooLarge) {
			h.reject(w, &req, CodeBodyTooLarge, fmt.Sprintf("the request body is larger than %d bytes, the most this endpoint fingerprints", h.MaxRequestBody))
		} else {
			h.reject(w, &req, CodeBodyUnreadable, "the request body could not be read: "+err.Error())
		}
		return
	}
	req.scope = h.ScopeFunc(r)
	req.fp = h.FingerprintFunc(r, req.body)
	if h.Flow == FlowSingleTx {
		h.serveSingleTx(w, &req)
		return
	}
	h.serveClaim(w, &req)
}

var errBodyTooLarge = errors.New("body too large")

// bodyReader replaces the request body after it was read for fingerprinting.
type bodyReader struct{ bytes.Reader }

func (*bodyReader) Close() error { return nil }

func (h *handler) readBody(r *http.Request) ([]byte, error) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	max := h.MaxRequestBody
	if r.ContentLength > max {
		return nil, errBodyTooLarge
	}
	var body []byte
	if r.ContentLength >= 0 {
		// Read one byte more than announced to notice a body that lies about its length.
		body = make([]byte, 0, r.ContentLength+1)
	}
	buf := bytes.NewBuffer(body)
	n, err := buf.ReadFrom(io.LimitReader(r.Body, max+1))
	_ = r.Body.Close()
	if err != nil {
		return nil, err
	}
	if n > max {
		return nil, errBodyTooLarge
	}
	body = buf.Bytes()
	br := &bodyReader{}
	br.Reset(body)
	r.Body = br
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
	if rec.CreatedAt.Before(now) {
		h.observe(req, Event{Kind: EventTakenOver})
	}
	h.execute(w, req, claim.Token)
}

// execute runs the handler of a claimed request and settles its outcome.
func (h *handler) execute(w http.ResponseWriter, req *request, token string) {
	r := req.r
	rw := &recorder{w: w, scope: req.scope, key: req.key}
	ctx, cancel := context.WithCancelCause(context.WithValue(r.Context(), recorderKey{}, rw))
	defer cancel(nil)
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
	rn := h.startRenewal(req, token, cancel)
	settled := false
	defer func() {
		if settled {
			return
		}
		// The handler panicked: leave nothing behind, then let the panic go on.
		rn.stop()
		cctx, ccancel := h.cleanupContext(r)
		defer ccancel()
		if tx != nil {
			_ = tx.Rollback(cctx)
		}
		h.release(req, token)
	}()
	h.next.ServeHTTP(rw, r.WithContext(ctx))
	settled = true
	rn.stop()

	cctx, ccancel := h.cleanupContext(r)
	defer ccancel()
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
		err := h.store.Complete(cctx, req.scope, req.key, token, resp, h.NowFunc().Add(h.TTL))
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
		h.problem(w, req, EventReleased, nil, CodeResponseTooLarge, fmt.Sprintf("the response body (%d bytes) is larger than MaxStoredBody (%d) and could not be kept for replay, so nothing was committed; raise MaxStoredBody or configure a ReplayFunc", rw.body.Len(), h.MaxStoredBody), 0)
		return
	}
	if err := tx.Complete(cctx, req.scope, req.key, token, resp, h.NowFunc().Add(h.TTL)); err != nil {
		_ = tx.Rollback(cctx)
		rw.discardHeaders()
		if errors.Is(err, ErrLockLost) || errors.Is(context.Cause(ctx), ErrLockLost) {
			h.problem(w, req, EventLeaseLost, err, CodeLeaseLost, "this request's lease lapsed and another request with the same key took over; nothing this request did was committed. Retry to get the outcome of the request that took over", 1)
			return
		}
		h.release(req, token)
		h.storeFailed(w, req, "complete", err)
		return
	}
	if err := tx.Commit(cctx); err != nil {
		h.release(req, token)
		rw.discardHeaders()
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
	rw := &recorder{w: w, scope: req.scope, key: req.key}
	ctx, tx, rec, err := h.singleTx.BeginLocked(context.WithValue(r.Context(), recorderKey{}, rw), req.scope, req.key, now)
	if errors.Is(err, ErrInFlight) {
		h.inFlight(w, req, 0)
		return
	}
	if err != nil {
		h.storeFailed(w, req, "begin locked transaction", err)
		return
	}
	if rec != nil {
		cctx, ccancel := h.cleanupContext(r)
		_ = tx.Rollback(cctx)
		ccancel()
		if match, _ := sameRequest(req.fp, rec.Fingerprint, r, req.body); !match {
			h.mismatch(w, req, rec)
		} else if rec.State == StateComplete {
			h.replay(w, req, rec)
		} else {
			h.inFlight(w, req, rec.LeaseUntil.Sub(now))
		}
		return
	}
	settled := false
	defer func() {
		if !settled {
			cctx, ccancel := h.cleanupContext(r)
			defer ccancel()
			_ = tx.Rollback(cctx)
		}
	}()
	h.next.ServeHTTP(rw, r.WithContext(ctx))
	settled = true

	cctx, ccancel := h.cleanupContext(r)
	defer ccancel()
	status := rw.statusOrOK()
	if !h.KeepFunc(status) {
		_ = tx.Rollback(cctx)
		rw.send()
		return
	}
	if rw.body.Len() > h.MaxStoredBody && h.ReplayFunc == nil {
		_ = tx.Rollback(cctx)
		rw.discardHeaders()
		h.problem(w, req, EventReleased, nil, CodeResponseTooLarge, fmt.Sprintf("the response body (%d bytes) is larger than MaxStoredBody (%d) and could not be kept for replay, so nothing was committed; raise MaxStoredBody or configure a ReplayFunc", rw.body.Len(), h.MaxStoredBody), 0)
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
		rw.discardHeaders()
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
			out[name] = append([]string(nil), v...)
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
		rw := &recorder{w: w, scope: req.scope, key: req.key}
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
	hdr.Set(ReplayedHeader, "true")
	hdr.Set("Content-Length", strconv.Itoa(len(resp.Body)))
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

// cleanupContext returns a context for store calls after the handler: it carries
// the request's values but does not end when the client goes away.
func (h *handler) cleanupContext(r *http.Request) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(r.Context()), h.CleanupTimeout)
}

// release gives the key up so that the next request runs afresh.
func (h *handler) release(req *request, token string) {
	ctx, cancel := h.cleanupContext(req.r)
	defer cancel()
	err := h.store.Release(ctx, req.scope, req.key, token)
	if errors.Is(err, ErrLockLost) {
		err = nil // someone took over, or the commit went through after all: nothing to undo
	}
	h.observe(req, Event{Kind: EventReleased, Err: err})
}

// renewal extends a claim's lease every Lease/3 while its handler runs, and
// cancels the handler's context when the lease turns out to be lost. Transient
// store errors are not a lost lease: renewal keeps trying, and the fenced
// completion has the last word.
type renewal struct {
	h      *handler
	req    *request
	token  string
	cancel context.CancelCauseFunc
	mu     sync.Mutex
	done   bool
	timer  *time.Timer
}

func (h *handler) startRenewal(req *request, token string, cancel context.CancelCauseFunc) *renewal {
	rn := &renewal{h: h, req: req, token: token, cancel: cancel}
	rn.timer = time.AfterFunc(h.Lease/3, rn.renew)
	return rn
}

func (rn *renewal) renew() {
	rn.mu.Lock()
	if rn.done {
		rn.mu.Unlock()
		return
	}
	rn.mu.Unlock()
	h := rn.h
	ctx, cancel := context.WithTimeout(context.WithoutCancel(rn.req.r.Context()), h.Lease/3)
	err := h.store.Extend(ctx, rn.req.scope, rn.req.key, rn.token, h.NowFunc().Add(h.Lease))
	cancel()
	rn.mu.Lock()
	defer rn.mu.Unlock()
	if rn.done {
		return
	}
	if errors.Is(err, ErrLockLost) {
		rn.done = true
		rn.cancel(ErrLockLost)
		h.observe(rn.req, Event{Kind: EventLeaseLost, Err: err})
		return
	}
	rn.timer.Reset(h.Lease / 3)
}

func (rn *renewal) stop() {
	rn.mu.Lock()
	rn.done = true
	rn.mu.Unlock()
	rn.timer.Stop()
}
