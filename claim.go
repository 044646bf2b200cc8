package idem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"
)

// The claim-then-complete flow: an atomic claim committed on its own, the
// handler under a renewed lease (inside a transaction with a TxStore), and the
// fenced completion; what happens when any of it fails.

// serveClaim is the claim-then-complete flow.
func (h *handler) serveClaim(w http.ResponseWriter, req *request) {
	ctx := req.r.Context()
	now := h.NowFunc()
	claim := h.newClaim(req, now)
	if h.LapsedLease == LapsedRefuse {
		// Refuse a lapsed record from a read, without writing: concurrent retries
		// must all get the refusal, never a 409 from a takeover in progress.
		if rec, err := h.store.Get(ctx, req.scope, req.key, now); err == nil && rec.State == StateInFlight && !rec.LeaseUntil.After(now) {
			if match, _ := sameRequest(req.fp, rec.Fingerprint, req.r, req.body); match {
				h.refuseUnknown(w, req, nil)
				return
			}
		}
	}
	rec, claimed, err := h.claimKey(req, claim)
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
			rec, claimed, err = h.claimKey(req, claim)
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
			h.awaitOutcome(w, req, rec.LeaseUntil)
			return
		}
	}
	takenOver := now.Sub(rec.CreatedAt) > time.Millisecond // a takeover keeps the first claim's CreatedAt; stores may round to milliseconds
	if takenOver && h.LapsedLease == LapsedRefuse {
		h.refuseLapsed(w, req, claim.Token, now)
		return
	}
	h.execute(w, req, claim.Token, takenOver)
}

// claimKey sends claim to the store. The claim runs to its end whether or
// not the client stays: a claim statement abandoned half-way may still commit
// (a MySQL claim waiting on a row lock, whose connection the driver closed),
// leaving the key in flight under a token nobody holds. It is bounded by the
// longer of Lease and CleanupTimeout instead. When it fails — its answer may
// have been lost after it committed — the claim is given up, fenced by its own
// token, best effort, on a context of its own: a retry then runs afresh rather
// than meeting 409 for a lease (and, under LapsedRefuse, an unknown outcome)
// for an operation that never ran.
func (h *handler) claimKey(req *request, claim ClaimRequest) (*Record, bool, error) {
	ctx, cancel := req.claimContext(h.wallAt(claim.Now), max(h.Lease, h.CleanupTimeout))
	rec, claimed, err := h.store.Claim(ctx, claim)
	req.endClaimContext(cancel)
	if err != nil {
		err = errors.Join(err, h.undoClaim(req, claim.Token))
	}
	return rec, claimed, err
}

// undoClaim releases the claim held under token, if there is one, on a
// context of its own (CleanupTimeout); a claim that was never made is nothing
// to undo.
func (h *handler) undoClaim(req *request, token string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(req.r.Context()), h.CleanupTimeout)
	defer cancel()
	err := h.store.Release(ctx, req.scope, req.key, token)
	if err == nil || errors.Is(err, ErrLockLost) {
		return nil
	}
	return fmt.Errorf("release the failed claim: %w", err)
}

// refuseLapsed answers a request that took over a lapsed lease under
// LapsedRefuse. The takeover fenced the lapsed holder out; the lease is put back
// to lapsed under the new token, so that the record stays in flight, unresolved,
// and the next request with the key is refused in the same way.
func (h *handler) refuseLapsed(w http.ResponseWriter, req *request, token string, now time.Time) {
	cctx := req.freshCleanup()
	err := h.store.Extend(cctx, req.scope, req.key, token, now, now)
	req.cctx.stop()
	h.refuseUnknown(w, req, err)
}

// refuseUnknown answers 503 idempotency_outcome_unknown (LapsedRefuse).
func (h *handler) refuseUnknown(w http.ResponseWriter, req *request, err error) {
	h.problem(w, req, EventInFlight, errors.Join(ErrOutcomeUnknown, err), CodeOutcomeUnknown,
		"an earlier request with this key did not finish (its server or upstream failed mid-request), so whether its operation took effect is unknown; it is not run again on its own. An operator resolves the key with idem resolve (an answer, or a release so that the next request runs it); until then every request with this key gets this answer", 0)
}

// execute runs the handler of a claimed request and settles its outcome;
// takenOver says the claim took a lapsed lease over.
func (h *handler) execute(w http.ResponseWriter, req *request, token string, takenOver bool) {
	r := req.r
	rw := req.recorder(w)
	if takenOver {
		h.keepSteps(req, token)
	}
	if h.reuseResponses {
		rw.usePooled()
		defer rw.releasePooled()
	}
	// The handler's context: the request's values, not the client's cancellation
	// (a claimed operation runs to its end), HandlerTimeout, and ErrLockLost as the
	// cause when the lease is lost.
	started := time.Now() // one reading for the handler's deadline and its lease renewal
	req.exec.init(r.Context(), h.handlerDeadlineAt(started), rw)
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
			if takenOver {
				h.observe(req, Event{Kind: EventTakenOver})
			}
			h.problem(w, req, EventStoreError, fmt.Errorf("begin transaction: %w", err), CodeStoreUnavailable,
				"the idempotency store could not start a transaction, so the request was not executed; "+retryNote(relErr), retrySeconds(relErr, h.Lease))
			return
		}
	}
	rw.limited, rw.limit = h.ReplayFunc == nil, h.MaxStoredBody
	if tx == nil {
		rw.spill = req
	}
	req.startTimerAt(token, true, started)
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
	// The events that start the hold come once the cleanup above is in place: an
	// Observer that panics on them must not leave the key held until its lease
	// lapses (under LapsedRefuse, until an operator resolves it).
	if takenOver {
		h.observe(req, Event{Kind: EventTakenOver})
	}
	h.claimed(req)
	h.next.ServeHTTP(rw, r.WithContext(ctx))
	rw.returned.Store(true)
	settled = true
	req.stopRenewal()
	h.settle(w, req, rw, hctx, tx, token)
}

// settle stores or gives up the outcome of the handler execute ran, and
// answers. It is a function of its own so that execute, with few returns left,
// gets open-coded defers.
func (h *handler) settle(w http.ResponseWriter, req *request, rw *recorder, hctx *execContext, tx Tx, token string) {
	ended := time.Now()
	cctx := req.freshCleanupAt(ended)
	defer req.cctx.stop()
	if req.spilled {
		return // too large to keep: stored without its body and streamed already
	}
	if rw.otherRequest.Load() {
		if tx != nil {
			_ = tx.Rollback(cctx)
		}
		h.otherRequest(w, req, rw, h.releaseKey(cctx, req, token))
		return
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
	stored := h.response(w, rw)
	defer stored.release()
	resp := &stored.Response
	if tx == nil {
		err := h.completeAt(cctx, req, token, resp, h.recordTime(ended))
		if errors.Is(err, ErrFieldTooLarge) {
			// The effects happened and the store cannot keep the answer whole:
			// keep that the operation completed, with its status, so that a
			// retry hears it rather than running it again.
			if err2 := h.complete(cctx, req, token, &Response{Status: status, BodyOmitted: true}); err2 != nil {
				err = errors.Join(err, err2)
			}
		}
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
	var err error
	if hctx.Err() != nil {
		// The handler ran past HandlerTimeout, or its lease was lost: its
		// transaction ends with its context on every store, whether or not the
		// store noticed in time.
		err = context.Cause(hctx)
	} else {
		now := h.NowFunc()
		err = tx.Complete(cctx, req.scope, req.key, token, resp, now, now.Add(h.TTL))
	}
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
	case errors.Is(err, ErrTxConflict):
		relErr := h.releaseKey(cctx, req, token)
		rw.discardHeaders()
		h.txConflict(w, req, err, relErr)
	case errors.Is(err, ErrTxAborted):
		h.txAborted(w, req, resp, err, func() error { return h.complete(cctx, req, token, resp) }, func() error { return h.releaseKey(cctx, req, token) })
	case errors.Is(err, ErrFieldTooLarge):
		relErr := h.releaseKey(cctx, req, token)
		rw.discardHeaders()
		h.outcomeTooLarge(w, req, err, relErr)
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
	resp := &Response{Status: status, Header: h.storedHeader(rw.header()), Ref: rw.ref, BodyOmitted: true}
	h.observeCompletion(req, status, h.complete(cctx, req, req.token, resp))
}

// response is the outcome to store for the handler's answer in rw. The caller
// releases it once the request's last store call returned; when the store
// copies what it keeps (ResponseCopier), its memory then goes to a later
// request.
func (h *handler) response(w http.ResponseWriter, rw *recorder) *storedResponse {
	var sr *storedResponse
	if rw.pooled != nil {
		sr = rw.pooled // returned by rw.releasePooled, with the body's storage
		sr.Response = Response{Status: rw.statusOrOK(), Header: h.recordedHeaderInto(sr, rw), Ref: rw.ref}
	} else if h.reuseResponses {
		sr = responsePool.Get().(*storedResponse)
		sr.pooled = true
		sr.Response = Response{Status: rw.statusOrOK(), Header: h.recordedHeaderInto(sr, rw), Ref: rw.ref}
	} else {
		sr = &storedResponse{Response: Response{Status: rw.statusOrOK(), Header: h.storedHeader(rw.header()), Ref: rw.ref}}
	}
	if h.ReplayFunc != nil || rw.overLimit() {
		sr.BodyOmitted = true
	} else {
		sr.Body = rw.body.Bytes()
	}
	return sr
}

// storedResponse is a Response with storage of its own for the header, reused
// across requests through responsePool when pooled.
type storedResponse struct {
	Response
	hdr    http.Header
	vals   []string
	pooled bool
	buf    []byte    // storage for a recorder's body (usePooled)
	owner  *recorder // the recorder whose body is in buf: it returns sr (releasePooled)
}

var responsePool = sync.Pool{New: func() any { return &storedResponse{hdr: make(http.Header, 4)} }}

// release gives sr's memory to a later request, if it is pooled.
func (sr *storedResponse) release() {
	if sr.owner != nil {
		return // its recorder returns it, once it let go of the body's storage
	}
	if !sr.pooled || len(sr.hdr) > 16 || cap(sr.vals) > 64 {
		return // not ours to reuse, or an unusual answer whose storage should go
	}
	clear(sr.hdr)
	clear(sr.vals)
	sr.vals = sr.vals[:0]
	sr.Response = Response{}
	responsePool.Put(sr)
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

// newClaim is the claim of req's key under a fresh token at now.
func (h *handler) newClaim(req *request, now time.Time) ClaimRequest {
	return ClaimRequest{
		Scope: req.scope, Key: req.key, Fingerprint: req.fp, Token: req.newToken(),
		Now: now, LeaseUntil: now.Add(h.Lease), ExpiresAt: now.Add(h.TTL),
	}
}

// complete stores resp as the outcome of the claim held under token, fenced,
// outside any transaction, to expire TTL from now.
func (h *handler) complete(ctx context.Context, req *request, token string, resp *Response) error {
	return h.completeAt(ctx, req, token, resp, h.NowFunc())
}

// completeAt is complete at now, a reading of NowFunc.
func (h *handler) completeAt(ctx context.Context, req *request, token string, resp *Response, now time.Time) error {
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

// txConflict answers a request whose transaction the database rolled back in
// a conflict with a concurrent one (ErrTxConflict): nothing committed, and a
// retry may well succeed.
func (h *handler) txConflict(w http.ResponseWriter, req *request, err, relErr error) {
	h.problem(w, req, EventReleased, errors.Join(err, relErr), CodeTxConflict,
		"the database rolled the handler's transaction back in a conflict with a concurrent transaction (a serialization failure or a deadlock), so nothing was committed; "+retryNote(relErr), retrySeconds(relErr, h.Lease))
}

// outcomeTooLarge answers a request whose outcome the store refused to keep
// (ErrFieldTooLarge): its transaction was rolled back. A retry would meet the
// same limit, so the answer is not retryable.
func (h *handler) outcomeTooLarge(w http.ResponseWriter, req *request, err, relErr error) {
	d := "the handler's outcome could not be kept for replay (" + err.Error() + "), so its transaction was rolled back and nothing was committed; a retry would meet the same limit"
	if relErr != nil {
		d += " (the key could not be released: retries get 409 until its lease lapses)"
	}
	h.problem(w, req, EventReleased, errors.Join(err, relErr), CodeResponseTooLarge, d, 0)
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
	return max(1, ceilSeconds(lease))
}

// commitFailedDetail explains a commit whose outcome is unknown.
func commitFailedDetail(relErr error) string {
	d := "the transaction's commit failed, so whether it took effect is not known here: if it did, a retry with the same key gets its stored outcome; if not, the retry runs the operation again"
	if relErr != nil {
		d += " (after the lease lapses: the key could not be released either)"
	}
	return d + "; retry with the same key"
}

// storedHeaderInto copies the allow-listed headers out of src into sr's
// storage (as storedHeader does), or returns nil when there are none.
func (h *handler) storedHeaderInto(sr *storedResponse, src http.Header) http.Header {
	for _, name := range h.storedHdrs {
		if v := src[name]; len(v) > 0 {
			sr.vals, sr.hdr[name] = appendOwn(sr.vals, v...)
		}
	}
	if len(sr.hdr) == 0 {
		return nil
	}
	return sr.hdr
}

// recordedHeaderInto is storedHeaderInto(sr, rw.header()). When the
// recorder's inline snapshot of the header at the handler's WriteHeader is
// what rw.header() returns (as the map itself when it did not change since,
// or rebuilt from the snapshot), it walks the snapshot's few entries instead
// of looking every allow-listed name up in the map.
func (h *handler) recordedHeaderInto(sr *storedResponse, rw *recorder) http.Header {
	s := &rw.snap
	if !s.taken || s.all != nil || len(h.storedHdrs) > 16 {
		return h.storedHeaderInto(sr, rw.header())
	}
	for _, e := range s.kv[:s.n] {
		if len(e.v) > 0 && slices.Contains(h.storedHdrs, e.k) {
			sr.vals, sr.hdr[e.k] = appendOwn(sr.vals, e.v...)
		}
	}
	if len(sr.hdr) == 0 {
		return nil
	}
	return sr.hdr
}

// storedHeader copies the allow-listed headers out of src, into storage of its
// own sized to fit: middleware outside idem may change the header map after
// the handler.
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
	return h.storedHeaderInto(&storedResponse{hdr: make(http.Header, names), vals: make([]string, 0, n)}, src)
}

// appendOwn appends v to vals, the shared storage of several header values, and
// returns the grown storage and v's copy in it, capped so that an append to the
// copy never overwrites its neighbour.
func appendOwn(vals []string, v ...string) (grown, own []string) {
	start := len(vals)
	vals = append(vals, v...)
	return vals, vals[start:len(vals):len(vals)]
}
