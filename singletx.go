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
	claim := h.newClaim(req, h.NowFunc())
	_, claimed, err := h.store.Claim(ctx, claim)
	if err != nil || !claimed {
		return err
	}
	return h.complete(ctx, req, claim.Token, resp)
}
