package idem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// The single-transaction flow: a transaction-scoped lock as the in-flight
// signal, the handler in that transaction, and the record written once, complete,
// with the one commit.

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
		h.awaitOutcome(w, req, time.Time{})
		return
	}
	if err != nil {
		h.storeFailed(w, req, "begin locked transaction", err)
		return
	}
	defer req.cctx.stop()
	if rec != nil {
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
			h.awaitOutcome(w, req, rec.LeaseUntil)
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
	h.claimed(req) // after the rollback above is in place: an Observer may panic
	h.next.ServeHTTP(rw, r.WithContext(ctx))
	rw.returned.Store(true)
	settled = true
	req.stopRenewal()

	cctx := req.freshCleanup()
	status := rw.statusOrOK()
	if rw.otherRequest.Load() {
		_ = tx.Rollback(cctx) // frees the key
		h.otherRequest(w, req, rw, nil)
		return
	}
	if rw.unknown {
		// The handler cannot know its outcome: nothing of its transaction is
		// kept, and the key is left in flight, as in claim-then-complete, under a
		// claim nobody completes: retries get 409 until its lease lapses, then
		// what LapsedLease says.
		_ = tx.Rollback(cctx)
		_, _, err := h.claimKey(req, h.newClaim(req, h.NowFunc()))
		h.observe(req, Event{Kind: EventInFlight, Status: status, Err: errors.Join(ErrOutcomeUnknown, err)})
		rw.send()
		return
	}
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
	stored := h.response(w, rw)
	defer stored.release()
	resp := &stored.Response
	rec = &Record{
		Scope: req.scope, Key: req.key, State: StateComplete, Fingerprint: req.fp,
		Token: newToken(), CreatedAt: now, LeaseUntil: done, ExpiresAt: done.Add(h.TTL), Response: resp,
	}
	if hctx.Err() != nil {
		// The handler ran past HandlerTimeout: its transaction ends with its
		// context on every store, whether or not the store noticed in time.
		err = context.Cause(hctx)
	} else {
		err = tx.Insert(cctx, rec)
	}
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
	case errors.Is(err, ErrFieldTooLarge):
		rw.discardHeaders()
		h.outcomeTooLarge(w, req, err, nil)
	case errors.Is(err, ErrTxConflict):
		rw.discardHeaders()
		h.txConflict(w, req, err, nil)
	case errors.Is(err, ErrTxAborted) && resp.Status >= http.StatusBadRequest:
		other, kerr := h.claimAndKeep(cctx, req, resp)
		if kerr == nil && other != nil {
			// Since the rollback freed the lock, another request with the key
			// claimed it (and may have committed its outcome): the client hears
			// what the record says, which every retry will hear too.
			if match, _ := sameRequest(req.fp, other.Fingerprint, r, req.body); match {
				rw.discardHeaders()
				if other.State == StateComplete {
					h.replay(w, req, other)
				} else {
					h.inFlight(w, req, other.LeaseUntil.Sub(h.NowFunc()))
				}
				return
			}
		}
		h.txAborted(w, req, resp, err, func() error { return kerr }, func() error { return nil })
	case errors.Is(err, ErrTxAborted):
		h.txAborted(w, req, resp, err, func() error { return nil }, func() error { return nil })
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
// is kept, and the caller answers as that request's record says.
//
// A claim or completion that fails is given up again, fenced by its own token
// (claimKey, undoClaim): the key must not stay in flight under a token nobody
// holds, for an operation whose transaction committed nothing.
//
// other is the record of another request that holds the key (nil when this
// one kept its answer or failed to).
func (h *handler) claimAndKeep(ctx context.Context, req *request, resp *Response) (other *Record, err error) {
	claim := h.newClaim(req, h.NowFunc())
	rec, claimed, err := h.claimKey(req, claim)
	if err != nil {
		return nil, err
	}
	if !claimed {
		return rec, nil
	}
	err = h.complete(ctx, req, claim.Token, resp)
	if err != nil && !errors.Is(err, ErrLockLost) {
		err = errors.Join(err, h.undoClaim(req, claim.Token))
	}
	return nil, err
}
