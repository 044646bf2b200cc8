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
	"strings"
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
	m := &middleware{settings: s, store: store, sched: newScheduler(s.Lease, s.HandlerTimeout)}
	m.txStore, _ = store.(TxStore)
	m.singleTx, _ = store.(SingleTxStore)
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
	spilled    bool // the outcome was stored early and the response streamed
	claimed    bool // the request holds the key: its next event ends the hold
	renewal
}

func (h *handler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if !h.isKeyed(r.Method) {
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
	req.scope = StoredScope(h.ScopeFunc(r))
	req.fp = h.FingerprintFunc(r, req.body)
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
		if h.LapsedLease == LapsedRefuse {
			h.refuseLapsed(w, req, claim.Token, now)
			return
		}
		h.observe(req, Event{Kind: EventTakenOver})
	}
	h.execute(w, req, claim.Token)
}

// refuseLapsed answers a request that took over a lapsed lease under
// LapsedRefuse. The takeover fenced the lapsed holder out; the lease is put back
// to lapsed under the new token, so that the record stays in flight, unresolved,
// and the next request with the key is refused in the same way.
func (h *handler) refuseLapsed(w http.ResponseWriter, req *request, token string, now time.Time) {
	cctx := req.freshCleanup()
	err := h.store.Extend(cctx, req.scope, req.key, token, now, now)
	req.cctx.stop()
	h.problem(w, req, EventInFlight, errors.Join(ErrOutcomeUnknown, err), CodeOutcomeUnknown,
		"an earlier request with this key did not finish (its server or upstream failed mid-request), so whether its operation took effect is unknown; it is not run again on its own. An operator resolves the key with idem resolve (an answer, or a release so that the next request runs it); until then every request with this key gets this answer", 0)
}

// execute runs the handler of a claimed request and settles its outcome.
func (h *handler) execute(w http.ResponseWriter, req *request, token string) {
	r := req.r
	h.claimed(req)
	rw := req.recorder(w)
	// The handler's context: the request's values, not the client's cancellation
	// (a claimed operation runs to its end), HandlerTimeout, and ErrLockLost as the
	// cause when the lease is lost.
	req.exec.init(r.Context(), h.handlerDeadline(), rw)
	defer req.exec.end(nil)
	hctx := &req.exec
	var ctx context.Context = hctx
	var tx Tx
	if h.txStore != nil {
		var err error
		ctx, tx, err = h.txStore.BeginTx(ctx)
		if err != nil {
			cctx := req.freshCleanup()
			defer req.cctx.stop()
			relErr := h.releaseKey(cctx, req, token)
			h.problem(w, req, EventStoreError, fmt.Errorf("begin transaction: %w", err), CodeStoreUnavailable,
				"the idempotency store could not start a transaction, so the request was not executed; "+retryNote(relErr), retrySeconds(relErr, h.Lease))
			return
		}
	}
	rw.limited, rw.limit = h.ReplayFunc == nil, h.MaxStoredBody
	if tx == nil {
		rw.spill = req.spillOutcome
	}
	req.startTimer(token, true)
	settled := false
	defer func() {
		if settled {
			return
		}
		// The handler panicked: leave nothing behind, then let the panic go on.
		req.stopRenewal()
		cctx := req.freshCleanup()
		if tx != nil {
			_ = tx.Rollback(cctx)
		}
		if !req.spilled {
			h.observe(req, Event{Kind: EventReleased, Err: h.releaseKey(cctx, req, token)})
		}
		req.cctx.stop()
	}()
	h.next.ServeHTTP(rw, r.WithContext(ctx))
	settled = true
	req.stopRenewal()

	cctx := req.freshCleanup()
	defer req.cctx.stop()
	if req.spilled {
		return // too large to keep: stored without its body and streamed already
	}
	if rw.unknown {
		// The handler cannot know its outcome: neither kept nor released, the
		// record stays in flight until its lease lapses (Config.LapsedLease).
		if tx != nil {
			_ = tx.Rollback(cctx)
		}
		h.observe(req, Event{Kind: EventInFlight, Status: rw.statusOrOK(), Err: ErrOutcomeUnknown})
		rw.send()
		return
	}
	status := rw.statusOrOK()
	if !h.KeepFunc(status) {
		if tx != nil {
			_ = tx.Rollback(cctx)
		}
		h.observe(req, Event{Kind: EventReleased, Status: status, Err: h.releaseKey(cctx, req, token)})
		rw.send()
		return
	}
	resp := h.response(w, rw)
	if tx == nil {
		now := h.NowFunc()
		err := h.store.Complete(cctx, req.scope, req.key, token, resp, now, now.Add(h.TTL))
		h.observeCompletion(req, status, err)
		rw.send() // the handler's effects happened; the client hears what they were
		return
	}
	if rw.overLimit() {
		_ = tx.Rollback(cctx)
		relErr := h.releaseKey(cctx, req, token)
		rw.discardHeaders()
		h.responseTooLarge(w, req, rw.size, relErr)
		return
	}
	now := h.NowFunc()
	err := tx.Complete(cctx, req.scope, req.key, token, resp, now, now.Add(h.TTL))
	committing := err == nil
	if committing {
		err = tx.Commit(cctx)
	}
	if err == nil {
		h.observe(req, Event{Kind: EventExecuted, Status: status})
		rw.send()
		return
	}
	_ = tx.Rollback(cctx)
	switch {
	case h.lockLost(err, req):
		rw.discardHeaders()
		h.leaseLost(w, req, err)
	case errors.Is(err, ErrTxAborted):
		h.txAborted(w, req, resp, err, func() error { return h.storeAborted(cctx, req, token, resp) }, func() error { return h.releaseKey(cctx, req, token) })
	case hctx.Err() != nil && !committing:
		relErr := h.releaseKey(cctx, req, token)
		rw.discardHeaders()
		h.problem(w, req, EventStoreError, fmt.Errorf("complete: %w", err), CodeCommitFailed,
			fmt.Sprintf("the handler ran past HandlerTimeout (%v), so its transaction was rolled back and nothing was committed; ", h.HandlerTimeout)+retryNote(relErr), retrySeconds(relErr, h.Lease))
	case !committing:
		relErr := h.releaseKey(cctx, req, token)
		rw.discardHeaders()
		h.problem(w, req, EventStoreError, fmt.Errorf("complete: %w", err), CodeStoreUnavailable,
			"the idempotency store failed while storing the outcome, so the transaction was rolled back and nothing was committed; "+retryNote(relErr), retrySeconds(relErr, h.Lease))
	default:
		// The commit's outcome is unknown: if it went through, the record is complete
		// and the release below changes nothing.
		relErr := h.releaseKey(cctx, req, token)
		rw.discardHeaders()
		h.problem(w, req, EventStoreError, fmt.Errorf("commit: %w", err), CodeCommitFailed, commitFailedDetail(relErr), retrySeconds(relErr, h.Lease))
	}
}

// spillOutcome is the recorder's spill in the claim-then-complete flow without a
// transaction: the response outgrew MaxStoredBody, so its outcome is stored now,
// without the body (retries get idempotency_response_too_large), and the rest of
// the response streams to the client. It runs on the handler's goroutine.
func (req *request) spillOutcome() {
	h, rw := req.h, &req.rw
	req.stopRenewal()
	req.spilled = true
	cctx := req.freshCleanup()
	status := rw.statusOrOK()
	if !h.KeepFunc(status) {
		h.observe(req, Event{Kind: EventReleased, Status: status, Err: h.releaseKey(cctx, req, req.token)})
		return
	}
	resp := &Response{Status: status, Header: h.storedHeader(rw.w.Header()), Ref: rw.ref, BodyOmitted: true}
	now := h.NowFunc()
	err := h.store.Complete(cctx, req.scope, req.key, req.token, resp, now, now.Add(h.TTL))
	h.observeCompletion(req, status, err)
}

// response is the outcome to store for the handler's answer in rw.
func (h *handler) response(w http.ResponseWriter, rw *recorder) *Response {
	resp := &Response{Status: rw.statusOrOK(), Header: h.storedHeader(w.Header()), Ref: rw.ref}
	if h.ReplayFunc != nil || rw.overLimit() {
		resp.BodyOmitted = true
	} else {
		resp.Body = rw.body.Bytes()
	}
	return resp
}

// observeCompletion reports the outcome of a completion outside a transaction.
func (h *handler) observeCompletion(req *request, status int, err error) {
	switch {
	case err == nil:
		h.observe(req, Event{Kind: EventExecuted, Status: status})
	case h.lockLost(err, req):
		h.observe(req, Event{Kind: EventLeaseLost, Status: status, Err: err})
	default:
		h.observe(req, Event{Kind: EventStoreError, Status: status, Err: fmt.Errorf("complete: %w", err)})
	}
}

// lockLost reports whether err, or the end of the handler's context, means the
// request's lease was lost: the one predicate for every completion and commit.
func (h *handler) lockLost(err error, req *request) bool {
	return errors.Is(err, ErrLockLost) || req.exec.lockLost()
}

// storeAborted keeps the handler's answer of a request whose transaction the
// database aborted, fenced by token, outside the transaction.
func (h *handler) storeAborted(ctx context.Context, req *request, token string, resp *Response) error {
	now := h.NowFunc()
	return h.store.Complete(ctx, req.scope, req.key, token, resp, now, now.Add(h.TTL))
}

// txAborted answers a request whose transaction the database had aborted, so
// that none of its writes committed. An error answer of the handler (a failed
// statement it caught and answered 4xx for) is the true outcome: it is kept with
// keep and sent, and a retry hears it again. A success answer is not true — the
// writes it reports were rolled back — so the key is given up with release and
// the client hears that nothing happened.
func (h *handler) txAborted(w http.ResponseWriter, req *request, resp *Response, cause error, keep, release func() error) {
	rw := &req.rw
	if resp.Status >= http.StatusBadRequest {
		err := keep()
		switch {
		case err == nil:
			h.observe(req, Event{Kind: EventExecuted, Status: resp.Status, Err: cause})
		case h.lockLost(err, req):
			rw.discardHeaders()
			h.leaseLost(w, req, err)
			return
		default:
			// Nothing was committed, so giving the key up is safe: a retry runs afresh.
			_ = release()
			h.observe(req, Event{Kind: EventStoreError, Status: resp.Status, Err: fmt.Errorf("keep the answer of an aborted transaction: %w", err)})
		}
		rw.send()
		return
	}
	relErr := release()
	rw.discardHeaders()
	h.problem(w, req, EventReleased, cause, CodeTxAborted,
		fmt.Sprintf("the database rolled the handler's transaction back (a statement in it failed, or it was chosen as a deadlock victim) although the handler answered %d, so nothing was committed; ", resp.Status)+retryNote(relErr), 0)
}

// serveSingleTx is the single-transaction flow.
func (h *handler) serveSingleTx(w http.ResponseWriter, req *request) {
	r := req.r
	now := h.NowFunc()
	rw := req.recorder(w)
	// Not req.exec: a driver may still watch this context after the transaction
	// ended, and a takeover below hands req.exec to the claim-then-complete flow.
	hctx := &execContext{}
	hctx.init(r.Context(), h.handlerDeadline(), rw)
	defer hctx.end(nil)
	ctx, tx, rec, err := h.singleTx.BeginLocked(hctx, req.scope, req.key, now)
	if errors.Is(err, ErrInFlight) {
		h.inFlight(w, req, 0)
		return
	}
	if err != nil {
		h.storeFailed(w, req, "begin locked transaction", err)
		return
	}
	defer req.cctx.stop()
	if rec == nil {
		h.claimed(req)
	} else {
		_ = tx.Rollback(req.freshCleanup())
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
	rw.limited, rw.limit = h.ReplayFunc == nil, h.MaxStoredBody
	if !hctx.deadline.IsZero() {
		req.deadlineOf = hctx // the timer ends hctx, not req.exec
		req.startTimer("", false)
	}
	settled := false
	defer func() {
		req.stopRenewal()
		if !settled {
			// The handler panicked: the rollback frees the lock, as a release would.
			_ = tx.Rollback(req.freshCleanup())
			h.observe(req, Event{Kind: EventReleased})
		}
	}()
	h.next.ServeHTTP(rw, r.WithContext(ctx))
	settled = true
	req.stopRenewal()

	cctx := req.freshCleanup()
	status := rw.statusOrOK()
	if !h.KeepFunc(status) {
		_ = tx.Rollback(cctx)
		h.observe(req, Event{Kind: EventReleased, Status: status})
		rw.send()
		return
	}
	if rw.overLimit() {
		_ = tx.Rollback(cctx)
		rw.discardHeaders()
		h.responseTooLarge(w, req, rw.size, nil)
		return
	}
	done := h.NowFunc()
	resp := h.response(w, rw)
	rec = &Record{
		Scope: req.scope, Key: req.key, State: StateComplete, Fingerprint: req.fp,
		Token: newToken(), CreatedAt: now, LeaseUntil: done, ExpiresAt: done.Add(h.TTL), Response: resp,
	}
	err = tx.Insert(cctx, rec)
	inserting := err == nil
	if inserting {
		err = tx.Commit(cctx)
	}
	if err == nil {
		h.observe(req, Event{Kind: EventExecuted, Status: status})
		rw.send()
		return
	}
	_ = tx.Rollback(cctx) // frees the lock of a store that did not on a failed commit
	switch {
	case errors.Is(err, ErrInFlight): // a claim-then-complete request holds the key
		rw.discardHeaders()
		h.inFlight(w, req, 0)
	case errors.Is(err, ErrTxAborted):
		h.txAborted(w, req, resp, err, func() error { return h.claimAndKeep(cctx, req, resp) }, func() error { return nil })
	case hctx.Err() != nil && !inserting:
		rw.discardHeaders()
		h.problem(w, req, EventStoreError, fmt.Errorf("insert record: %w", err), CodeCommitFailed,
			fmt.Sprintf("the handler ran past HandlerTimeout (%v), so its transaction was rolled back and nothing was committed; retry with the same key", h.HandlerTimeout), 1)
	case !inserting:
		rw.discardHeaders()
		h.storeFailed(w, req, "insert record", err)
	default:
		rw.discardHeaders()
		h.problem(w, req, EventStoreError, fmt.Errorf("commit: %w", err), CodeCommitFailed, commitFailedDetail(nil), 1)
	}
}

// claimAndKeep keeps resp as the outcome of a single-transaction request whose
// transaction the database aborted: it claims the key outside the transaction
// and completes the claim. When another request holds the key by now, nothing
// is kept and the answer still goes to this client.
func (h *handler) claimAndKeep(ctx context.Context, req *request, resp *Response) error {
	now := h.NowFunc()
	claim := ClaimRequest{
		Scope: req.scope, Key: req.key, Fingerprint: req.fp, Token: newToken(),
		Now: now, LeaseUntil: now.Add(h.Lease), ExpiresAt: now.Add(h.TTL),
	}
	_, claimed, err := h.store.Claim(ctx, claim)
	if err != nil || !claimed {
		return err
	}
	return h.store.Complete(ctx, req.scope, req.key, claim.Token, resp, now, now.Add(h.TTL))
}

// retryNote ends a problem detail with what a retry will meet, given the error
// of releasing the key.
func retryNote(relErr error) string {
	if relErr == nil {
		return "the key was released: retry with the same key"
	}
	return "the key could not be released either (the store failed), so retries with the same key get 409 until its lease lapses and then run afresh"
}

// retrySeconds is the Retry-After of a problem after which the key was released
// (1 s), or could not be (the lease).
func retrySeconds(relErr error, lease time.Duration) int {
	if relErr == nil {
		return 1
	}
	return max(1, int((lease+time.Second-1)/time.Second))
}

// commitFailedDetail explains a commit whose outcome is unknown.
func commitFailedDetail(relErr error) string {
	d := "the transaction's commit failed, so whether it took effect is not known here: if it did, a retry with the same key gets its stored outcome; if not, the retry runs the operation again"
	if relErr != nil {
		d += " (after the lease lapses: the key could not be released either)"
	}
	return d + "; retry with the same key"
}

// storedHeader copies the allow-listed headers out of src, into storage of its
// own: middleware outside idem may change the header map after the handler.
func (h *handler) storedHeader(src http.Header) http.Header {
	n, names := 0, 0
	for _, name := range h.storedHdrs {
		if v := src[name]; len(v) > 0 {
			n += len(v)
			names++
		}
	}
	if n == 0 {
		return nil
	}
	out := make(http.Header, names)
	vals := make([]string, 0, n)
	for _, name := range h.storedHdrs {
		if v, ok := src[name]; ok && len(v) > 0 {
			start := len(vals)
			vals = append(vals, v...)
			out[name] = vals[start:len(vals):len(vals)]
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
	// The stored values are shared by every replay and must not reach a header
	// map that outer middleware may change: copy them, into one allocation.
	n := 1
	for _, v := range resp.Header {
		n += len(v)
	}
	vals := make([]string, 0, n)
	for k, v := range resp.Header {
		start := len(vals)
		vals = append(vals, v...)
		hdr[k] = vals[start:len(vals):len(vals)]
	}
	vals = append(vals, "true")
	hdr[ReplayedHeader] = vals[len(vals)-1 : len(vals) : len(vals)]
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

// claimed marks req as holding its key, and tells an Observer that wants it.
func (h *handler) claimed(req *request) {
	if h.observeClaims {
		h.observe(req, Event{Kind: EventClaimed})
	}
	req.claimed = true
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
	req.rw = recorder{w: w, scope: req.scope, key: req.key}
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

// handlerDeadline returns when a handler starting now must end (HandlerTimeout),
// on the wall clock, or the zero time for none.
func (h *handler) handlerDeadline() time.Time {
	if h.HandlerTimeout <= 0 {
		return time.Time{}
	}
	return time.Now().Add(h.HandlerTimeout)
}

// renewal is what the middleware's scheduler does for a running handler: it
// extends the claim's lease every Lease/3 (when renew is set) and ends the
// handler's context when the lease turns out to be lost (cause ErrLockLost,
// which the completion then reports) or at its deadline (HandlerTimeout).
// Transient store errors are not a lost lease: renewal keeps trying, and the
// fenced completion has the last word. It is embedded in request.
type renewal struct {
	token      string
	renew      bool
	deadlineOf *execContext // the context the deadline ends; &req.exec when nil
	mu         sync.Mutex
	done       bool
	expired    bool      // the deadline has passed
	renewing   bool      // an Extend is on its way
	nextRenew  time.Time // wall clock
	// The scheduler's list of running handlers; guarded by the scheduler's mu.
	schedPrev, schedNext *request
	scheduled            bool
}

// startTimer hands the running handler to the scheduler.
func (req *request) startTimer(token string, renew bool) {
	req.mu.Lock()
	req.token, req.renew = token, renew
	if req.deadlineOf == nil {
		req.deadlineOf = &req.exec
	}
	req.nextRenew = time.Now().Add(req.h.Lease / 3)
	req.mu.Unlock()
	req.h.sched.add(req)
}

// stopRenewal takes the handler off the scheduler; an Extend already on its way
// is ignored when it returns.
func (req *request) stopRenewal() {
	req.mu.Lock()
	req.done = true
	req.mu.Unlock()
	req.h.sched.remove(req)
}

// fire does what is due at now: the deadline, and a renewal in a goroutine of
// its own (a slow store must not hold up the other handlers' renewals).
func (req *request) fire(now time.Time) {
	req.mu.Lock()
	if req.done {
		req.mu.Unlock()
		return
	}
	if dl := req.deadlineOf.deadline; !req.expired && !dl.IsZero() && !now.Before(dl) {
		req.expired = true
		req.deadlineOf.end(context.DeadlineExceeded)
	}
	extend := req.renew && !req.renewing && !now.Before(req.nextRenew)
	req.renewing = req.renewing || extend
	req.mu.Unlock()
	if extend {
		go req.extend()
	}
}

func (req *request) extend() {
	h := req.h
	ctx, cancel := context.WithTimeout(context.WithoutCancel(req.r.Context()), h.Lease/3)
	at := h.NowFunc()
	err := h.store.Extend(ctx, req.scope, req.key, req.token, at, at.Add(h.Lease))
	cancel()
	req.mu.Lock()
	defer req.mu.Unlock()
	req.renewing = false
	if req.done {
		return
	}
	if errors.Is(err, ErrLockLost) {
		req.done = true
		req.deadlineOf.end(ErrLockLost)
		return
	}
	req.nextRenew = time.Now().Add(h.Lease / 3)
}

// scheduler keeps the lease renewals and deadlines of a middleware's running
// handlers with one ticker, so that a request costs no timer of its own. Its
// goroutine runs only while handlers run. A renewal is due Lease/3 after the
// last one and happens within a tick of that (a tick is at most Lease/12, so
// within 5/12 of the lease); a deadline is kept within a tick (at most a quarter of
// HandlerTimeout, and never more than a second).
type scheduler struct {
	tick    time.Duration
	mu      sync.Mutex
	head    *request
	running bool
	due     []*request // reused by run
}

func newScheduler(lease, handlerTimeout time.Duration) *scheduler {
	tick := min(lease/12, time.Second)
	if handlerTimeout > 0 {
		tick = min(tick, handlerTimeout/4)
	}
	return &scheduler{tick: max(tick, time.Millisecond)}
}

func (s *scheduler) add(req *request) {
	s.mu.Lock()
	req.schedPrev, req.schedNext, req.scheduled = nil, s.head, true
	if s.head != nil {
		s.head.schedPrev = req
	}
	s.head = req
	start := !s.running
	s.running = true
	s.mu.Unlock()
	if start {
		go s.run()
	}
}

func (s *scheduler) remove(req *request) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !req.scheduled {
		return
	}
	if req.schedPrev != nil {
		req.schedPrev.schedNext = req.schedNext
	} else {
		s.head = req.schedNext
	}
	if req.schedNext != nil {
		req.schedNext.schedPrev = req.schedPrev
	}
	req.schedPrev, req.schedNext, req.scheduled = nil, nil, false
}

// run ticks while handlers run, and returns when none is left.
func (s *scheduler) run() {
	t := time.NewTicker(s.tick)
	defer t.Stop()
	for range t.C {
		now := time.Now()
		s.mu.Lock()
		if s.head == nil {
			s.running = false
			s.mu.Unlock()
			return
		}
		s.due = s.due[:0]
		for r := s.head; r != nil; r = r.schedNext {
			s.due = append(s.due, r)
		}
		due := s.due
		s.mu.Unlock()
		for _, r := range due {
			r.fire(now) // a request removed meanwhile is done: fire does nothing
		}
		clear(due) // hold no finished request
	}
}

// setContentLength sets Content-Length for bodies net/http would otherwise send
// chunked; for smaller ones net/http sets it itself, at no cost to us.
func setContentLength(h http.Header, n int) {
	if n >= 2048 && h.Get("Content-Length") == "" {
		h.Set("Content-Length", strconv.Itoa(n))
	}
}
