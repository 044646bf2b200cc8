package idemobs

import (
	"context"
	"time"

	"github.com/idemkit/idem"
)

// Store returns s with every operation reported to o. The result implements
// exactly the optional interfaces s implements — idem.TxStore,
// idem.SingleTxStore, idem.FlowPreferrer — so the middleware keeps
// transactional completion and the single-transaction flow; it implements
// idem.ResponseCopier always, answering as s does (false when s does not
// implement it), so the middleware reuses response memory as it would with s.
// The transactions it opens are decorated too (Tx.Complete, Tx.Commit,
// LockedTx.Insert, LockedTx.Commit), and the context a transaction's BeginTx
// or BeginLocked returns is the store's own, so its package's accessor
// (sqlitestore.Tx, pgstore.Tx, …) finds the transaction. Unwrap returns s.
func Store(s idem.Store, o StoreObserver) idem.Store {
	b := &base{s: s, o: o}
	tx, isTx := s.(idem.TxStore)
	single, isSingle := s.(idem.SingleTxStore)
	pref, isPref := s.(idem.FlowPreferrer)
	t, l, p := txPart{b, tx}, singlePart{b, single}, prefPart{pref}
	switch {
	case isTx && isSingle && isPref:
		return &storeTLP{b, t, l, p}
	case isTx && isSingle:
		return &storeTL{b, t, l}
	case isTx && isPref:
		return &storeTP{b, t, p}
	case isSingle && isPref:
		return &storeLP{b, l, p}
	case isTx:
		return &storeT{b, t}
	case isSingle:
		return &storeL{b, l}
	case isPref:
		return &storeP{b, p}
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

// start begins an operation; done ends it.
func (b *base) start(ctx context.Context, op Op) (context.Context, time.Time) {
	return b.o.StoreStart(ctx, op), time.Now()
}

func (b *base) done(ctx context.Context, op Op, t0 time.Time, err error) {
	b.o.StoreDone(ctx, op, time.Since(t0), err)
}

// undoOnPanic, deferred after an operation that took something (a claim, a
// transaction), runs undo and lets the panic go on when the observer panics
// while told of it: the caller never gets what was taken, so nothing else would
// give it back (a claimed key would stay held until its lease lapsed).
func undoOnPanic(undo func()) {
	if v := recover(); v != nil {
		undo()
		panic(v)
	}
}

func (b *base) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	ctx, t0 := b.start(ctx, OpClaim)
	rec, claimed, err := b.s.Claim(ctx, req)
	defer undoOnPanic(func() {
		if claimed && err == nil { // the caller never learns of its claim
			_ = b.s.Release(context.WithoutCancel(ctx), req.Scope, req.Key, req.Token)
		}
	})
	b.done(ctx, OpClaim, t0, err)
	return rec, claimed, err
}

func (b *base) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	ctx, t0 := b.start(ctx, OpComplete)
	err := b.s.Complete(ctx, scope, key, token, resp, now, expiresAt)
	b.done(ctx, OpComplete, t0, err)
	return err
}

func (b *base) Release(ctx context.Context, scope, key, token string) error {
	ctx, t0 := b.start(ctx, OpRelease)
	err := b.s.Release(ctx, scope, key, token)
	b.done(ctx, OpRelease, t0, err)
	return err
}

func (b *base) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	ctx, t0 := b.start(ctx, OpExtend)
	err := b.s.Extend(ctx, scope, key, token, now, leaseUntil)
	b.done(ctx, OpExtend, t0, err)
	return err
}

func (b *base) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	ctx, t0 := b.start(ctx, OpGet)
	rec, err := b.s.Get(ctx, scope, key, now)
	b.done(ctx, OpGet, t0, err)
	return rec, err
}

func (b *base) DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error) {
	ctx, t0 := b.start(ctx, OpDeleteExpired)
	n, err := b.s.DeleteExpired(ctx, now, limit)
	b.done(ctx, OpDeleteExpired, t0, err)
	return n, err
}

// txPart decorates idem.TxStore.
type txPart struct {
	b  *base
	tx idem.TxStore
}

func (p txPart) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	octx, t0 := p.b.start(ctx, OpBegin)
	txCtx, tx, err := p.tx.BeginTx(ctx)
	defer undoOnPanic(func() {
		if err == nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	})
	p.b.done(octx, OpBegin, t0, err)
	if err != nil {
		return txCtx, tx, err
	}
	return txCtx, &obsTx{b: p.b, tx: tx}, nil
}

type obsTx struct {
	b  *base
	tx idem.Tx
}

func (t *obsTx) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	ctx, t0 := t.b.start(ctx, OpComplete)
	err := t.tx.Complete(ctx, scope, key, token, resp, now, expiresAt)
	t.b.done(ctx, OpComplete, t0, err)
	return err
}

func (t *obsTx) Commit(ctx context.Context) error {
	ctx, t0 := t.b.start(ctx, OpCommit)
	err := t.tx.Commit(ctx)
	t.b.done(ctx, OpCommit, t0, err)
	return err
}

func (t *obsTx) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

// singlePart decorates idem.SingleTxStore.
type singlePart struct {
	b      *base
	single idem.SingleTxStore
}

func (p singlePart) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	octx, t0 := p.b.start(ctx, OpBegin)
	txCtx, tx, rec, err := p.single.BeginLocked(ctx, scope, key, now)
	defer undoOnPanic(func() {
		if err == nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	})
	p.b.done(octx, OpBegin, t0, err)
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
	ctx, t0 := t.b.start(ctx, OpInsert)
	err := t.tx.Insert(ctx, rec)
	t.b.done(ctx, OpInsert, t0, err)
	return err
}

func (t *obsLockedTx) Commit(ctx context.Context) error {
	ctx, t0 := t.b.start(ctx, OpCommit)
	err := t.tx.Commit(ctx)
	t.b.done(ctx, OpCommit, t0, err)
	return err
}

func (t *obsLockedTx) Rollback(ctx context.Context) error { return t.tx.Rollback(ctx) }

// prefPart forwards idem.FlowPreferrer.
type prefPart struct{ p idem.FlowPreferrer }

func (p prefPart) PreferredFlow() idem.Flow { return p.p.PreferredFlow() }
