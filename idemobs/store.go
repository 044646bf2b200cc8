package idemobs

import (
	"context"
	"log"
	"time"

	"github.com/idemkit/idem"
)

// Store returns s with every operation reported to o. The result implements
// exactly the optional interfaces s implements — idem.TxStore,
// idem.SingleTxStore, idem.FlowPreferrer, idem.StepStore — so the middleware
// keeps transactional completion, the single-transaction flow and steps
// (idem.Step); the step operations are forwarded, not reported; it implements
// idem.ResponseCopier always, answering as s does (false when s does not
// implement it), so the middleware reuses response memory as it would with s.
// The transactions it opens are decorated too (Tx.Complete, Tx.Commit,
// LockedTx.Insert, LockedTx.Commit), and the context a transaction's BeginTx
// or BeginLocked returns is the store's own, so its package's accessor
// (sqlitestore.Tx, pgstore.Tx, …) finds the transaction. Unwrap returns s.
//
// An observer's panic never leaves a transaction open or a key claimed: the
// operation runs and is reported, what its caller will never learn of is given
// back (rolled back, released), and the panic goes on; on idem's own
// goroutines (Extend for the lease renewal, DeleteExpired for the janitor) it
// is logged and stopped.
func Store(s idem.Store, o StoreObserver) idem.Store {
	b := &base{s: s, o: o}
	tx, isTx := s.(idem.TxStore)
	single, isSingle := s.(idem.SingleTxStore)
	pref, isPref := s.(idem.FlowPreferrer)
	t, l, p := txPart{b, tx}, singlePart{b, single}, prefPart{pref}
	steps, isSteps := s.(idem.StepStore)
	st := stepsPart{steps}
	switch {
	case isTx && isSingle && isPref && isSteps:
		return &storeTLPS{b, t, l, p, st}
	case isTx && isSingle && isPref:
		return &storeTLP{b, t, l, p}
	case isTx && isSingle && isSteps:
		return &storeTLS{b, t, l, st}
	case isTx && isSingle:
		return &storeTL{b, t, l}
	case isTx && isPref && isSteps:
		return &storeTPS{b, t, p, st}
	case isTx && isPref:
		return &storeTP{b, t, p}
	case isSingle && isPref && isSteps:
		return &storeLPS{b, l, p, st}
	case isSingle && isPref:
		return &storeLP{b, l, p}
	case isTx && isSteps:
		return &storeTS{b, t, st}
	case isTx:
		return &storeT{b, t}
	case isSingle && isSteps:
		return &storeLS{b, l, st}
	case isSingle:
		return &storeL{b, l}
	case isPref && isSteps:
		return &storePS{b, p, st}
	case isPref:
		return &storeP{b, p}
	case isSteps:
		return &storeS{b, st}
	}
	return b
}

// Unwrapper is implemented by the stores Store returns.
type Unwrapper interface {
	// Unwrap returns the decorated store.
	Unwrap() idem.Store
}

type (
	storeTLP struct {
		*base
		txPart
		singlePart
		prefPart
	}
	storeTL struct {
		*base
		txPart
		singlePart
	}
	storeTP struct {
		*base
		txPart
		prefPart
	}
	storeLP struct {
		*base
		singlePart
		prefPart
	}
	storeT struct {
		*base
		txPart
	}
	storeL struct {
		*base
		singlePart
	}
	storeP struct {
		*base
		prefPart
	}
)

// The decorators of stores that keep step records (idem.StepStore).
type (
	storeTLPS struct {
		*base
		txPart
		singlePart
		prefPart
		stepsPart
	}
	storeTLS struct {
		*base
		txPart
		singlePart
		stepsPart
	}
	storeTPS struct {
		*base
		txPart
		prefPart
		stepsPart
	}
	storeLPS struct {
		*base
		singlePart
		prefPart
		stepsPart
	}
	storeTS struct {
		*base
		txPart
		stepsPart
	}
	storeLS struct {
		*base
		singlePart
		stepsPart
	}
	storePS struct {
		*base
		prefPart
		stepsPart
	}
	storeS struct {
		*base
		stepsPart
	}
)

// stepsPart forwards idem.StepStore. The step operations are not reported to
// the StoreObserver (Op has no names for them yet): they reach the decorated
// store unchanged, so that idem.Step works through a decorated store.
type stepsPart struct{ s idem.StepStore }

func (p stepsPart) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	return p.s.BeginStep(ctx, req)
}

func (p stepsPart) FinishStep(ctx context.Context, scope, key, name, owner string, state idem.StepState, result []byte, now time.Time) error {
	return p.s.FinishStep(ctx, scope, key, name, owner, state, result, now)
}

func (p stepsPart) AbandonStep(ctx context.Context, scope, key, name, owner string, now time.Time) error {
	return p.s.AbandonStep(ctx, scope, key, name, owner, now)
}

func (p stepsPart) GetSteps(ctx context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	return p.s.GetSteps(ctx, scope, key, now)
}

func (p stepsPart) SettleStep(ctx context.Context, scope, key, name string, state idem.StepState, result []byte, now time.Time) error {
	return p.s.SettleStep(ctx, scope, key, name, state, result, now)
}

func (p stepsPart) DeleteExpiredSteps(ctx context.Context, now time.Time, limit int) (int, error) {
	return p.s.DeleteExpiredSteps(ctx, now, limit)
}

// base decorates the methods of idem.Store.
type base struct {
	s idem.Store
	o StoreObserver
}

func (b *base) Unwrap() idem.Store { return b.s }

// CopiesResponses implements idem.ResponseCopier as the decorated store does:
// the decorators hand every response straight to it and keep nothing, so
// whether the caller may reuse a response's memory is its answer (false when
// it does not implement the interface).
func (b *base) CopiesResponses() bool {
	c, ok := b.s.(idem.ResponseCopier)
	return ok && c.CopiesResponses()
}

// An observer's panic never stops the operation it is told about, nor leaves
// behind what the operation took. start and done catch it; the operation runs
// and is reported; then the decorator gives back what its caller will never
// learn of (a claim, a transaction: on SQLite an open transaction holds the
// write lock, and every later request would wait for it and fail) and lets the
// panic go on, as a panicking handler's would. On the goroutines idem runs
// for itself (lease renewal, the janitor), where a panic would kill the
// process, the panic is logged and goes no further.

// start begins an operation: the observer's context, the start time, and the
// observer's panic (nil when it did not panic).
func (b *base) start(ctx context.Context, op Op) (out context.Context, t0 time.Time, p any) {
	out = ctx
	defer func() {
		if p = recover(); p != nil {
			t0 = time.Now()
		}
	}()
	if c := b.o.StoreStart(ctx, op); c != nil {
		out = c
	}
	return out, time.Now(), nil
}

// done ends an operation; it returns p, the panic of start, or else the
// observer's panic in StoreDone.
func (b *base) done(ctx context.Context, op Op, t0 time.Time, err error, p any) (out any) {
	out = p
	defer func() {
		if v := recover(); v != nil && out == nil {
			out = v
		}
	}()
	b.o.StoreDone(ctx, op, time.Since(t0), err)
	return p
}

// rethrow runs undo, then panics with p, when the observer panicked (p not nil).
func rethrow(p any, undo func()) {
	if p == nil {
		return
	}
	if undo != nil {
		undo()
	}
	panic(p)
}

// logPanic reports p, an observer's panic on one of idem's own goroutines,
// instead of letting it kill the process.
func logPanic(p any, op Op) {
	if p != nil {
		log.Printf("idemobs: the StoreObserver panicked on %s (the operation ran; the panic was stopped here, because it would kill the process): %v", op, p)
	}
}

func (b *base) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	ctx, t0, p := b.start(ctx, OpClaim)
	rec, claimed, err := b.s.Claim(ctx, req)
	rethrow(b.done(ctx, OpClaim, t0, err, p), func() {
		if claimed && err == nil { // the caller never learns of its claim
			_ = b.s.Release(context.WithoutCancel(ctx), req.Scope, req.Key, req.Token)
		}
	})
	return rec, claimed, err
}

func (b *base) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	ctx, t0, p := b.start(ctx, OpComplete)
	err := b.s.Complete(ctx, scope, key, token, resp, now, expiresAt)
	rethrow(b.done(ctx, OpComplete, t0, err, p), nil) // what is stored stays stored
	return err
}

func (b *base) Release(ctx context.Context, scope, key, token string) error {
	ctx, t0, p := b.start(ctx, OpRelease)
	err := b.s.Release(ctx, scope, key, token)
	rethrow(b.done(ctx, OpRelease, t0, err, p), nil)
	return err
}

// Extend runs on the middleware's renewal goroutine: an observer's panic is
// logged, not passed on (it would kill the process and stop the renewal).
func (b *base) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	ctx, t0, p := b.start(ctx, OpExtend)
	err := b.s.Extend(ctx, scope, key, token, now, leaseUntil)
	logPanic(b.done(ctx, OpExtend, t0, err, p), OpExtend)
	return err
}

func (b *base) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	ctx, t0, p := b.start(ctx, OpGet)
	rec, err := b.s.Get(ctx, scope, key, now)
	rethrow(b.done(ctx, OpGet, t0, err, p), nil)
	return rec, err
}

// DeleteExpired runs on the janitor's goroutine: an observer's panic is
// logged, not passed on.
func (b *base) DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error) {
	ctx, t0, p := b.start(ctx, OpDeleteExpired)
	n, err := b.s.DeleteExpired(ctx, now, limit)
	logPanic(b.done(ctx, OpDeleteExpired, t0, err, p), OpDeleteExpired)
	return n, err
}

// txPart decorates idem.TxStore.
type txPart struct {
	b  *base
	tx idem.TxStore
}

func (p txPart) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	octx, t0, pv := p.b.start(ctx, OpBegin)
	txCtx, tx, err := p.tx.BeginTx(ctx)
	rethrow(p.b.done(octx, OpBegin, t0, err, pv), func() {
		if err == nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	})
	if err != nil {
		return txCtx, tx, err
	}
	return txCtx, &obsTx{b: p.b, tx: tx}, nil
}

type obsTx struct {
	b  *base
	tx idem.Tx
}

// giveBack rolls the transaction back and releases the claim: the middleware,
// unwound by the observer's panic, will neither commit nor roll back.
func (t *obsTx) giveBack(ctx context.Context, scope, key, token string) {
	ctx = context.WithoutCancel(ctx)
	_ = t.tx.Rollback(ctx)
	_ = t.b.s.Release(ctx, scope, key, token)
}

func (t *obsTx) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	ctx, t0, p := t.b.start(ctx, OpComplete)
	err := t.tx.Complete(ctx, scope, key, token, resp, now, expiresAt)
	rethrow(t.b.done(ctx, OpComplete, t0, err, p), func() { t.giveBack(ctx, scope, key, token) })
	return err
}

func (t *obsTx) Commit(ctx context.Context) error {
	ctx, t0, p := t.b.start(ctx, OpCommit)
	err := t.tx.Commit(ctx)
	rethrow(t.b.done(ctx, OpCommit, t0, err, p), func() {
		// Committed, the outcome is stored; otherwise the transaction must not
		// stay open. A failed commit may have committed all the same: the claim
		// is left to lapse, as the middleware would leave it.
		if err != nil {
			_ = t.tx.Rollback(context.WithoutCancel(ctx))
		}
	})
	return err
}

func (t *obsTx) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

// singlePart decorates idem.SingleTxStore.
type singlePart struct {
	b      *base
	single idem.SingleTxStore
}

func (p singlePart) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	octx, t0, pv := p.b.start(ctx, OpBegin)
	txCtx, tx, rec, err := p.single.BeginLocked(ctx, scope, key, now)
	rethrow(p.b.done(octx, OpBegin, t0, err, pv), func() {
		if err == nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	})
	if err != nil {
		return txCtx, tx, rec, err
	}
	return txCtx, &obsLockedTx{b: p.b, tx: tx}, rec, nil
}

type obsLockedTx struct {
	b  *base
	tx idem.LockedTx
}

func (t *obsLockedTx) Insert(ctx context.Context, rec *idem.Record) error {
	ctx, t0, p := t.b.start(ctx, OpInsert)
	err := t.tx.Insert(ctx, rec)
	// The rollback frees the lock and drops the record with the handler's
	// writes: the key is free again, as after a release.
	rethrow(t.b.done(ctx, OpInsert, t0, err, p), func() { _ = t.tx.Rollback(context.WithoutCancel(ctx)) })
	return err
}

func (t *obsLockedTx) Commit(ctx context.Context) error {
	ctx, t0, p := t.b.start(ctx, OpCommit)
	err := t.tx.Commit(ctx)
	rethrow(t.b.done(ctx, OpCommit, t0, err, p), func() {
		if err != nil {
			_ = t.tx.Rollback(context.WithoutCancel(ctx))
		}
	})
	return err
}

func (t *obsLockedTx) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

// prefPart forwards idem.FlowPreferrer.
type prefPart struct{ p idem.FlowPreferrer }

func (p prefPart) PreferredFlow() idem.Flow { return p.p.PreferredFlow() }
