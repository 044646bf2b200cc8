package idem

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"
)

// Waiting for the outcome (Config.InFlightWait): a request that finds its key
// in flight, held by the same request, waits for the holder to let go and is
// answered with the replay, instead of 409.
//
// The waiters of one key in one middleware share one prober: a goroutine that
// watches the key (OutcomeNotifier, when the store is one) and reads it with
// Store.Get, at a backoff, on a notification, when a waiter joins and when the
// holder's lease lapses. When the record is complete it hands the record to
// every waiter at once (one read for any number of waiters); when the holder
// let go without an outcome (released, lapsed, or its transaction ended) the
// waiters try again as fresh requests. A waiting request holds no store
// connection: only the prober's reads take one, for a moment.

// Defaults for the waiting bounds.
const (
	// DefaultInFlightMaxWaiters is the default of Config.InFlightMaxWaiters.
	DefaultInFlightMaxWaiters = 10000
	// DefaultInFlightMaxWaitersPerKey is the default of
	// Config.InFlightMaxWaitersPerKey.
	DefaultInFlightMaxWaitersPerKey = 1000
)

// OutcomeNotifier is implemented by stores that can wake a request waiting for
// a key's outcome (Config.InFlightWait) in every process sharing the store —
// PostgreSQL with LISTEN/NOTIFY, Redis with pub/sub, memstore in its process.
// Without it the middleware polls the key with Store.Get, at a backoff.
type OutcomeNotifier interface {
	// WatchOutcome starts watching (scope, key): from the moment it returns,
	// every NotifyOutcome of the key, by any process, sends on wake (without
	// blocking: several notifications may arrive as one). A notification may
	// also be spurious (another key's, or one sent while the store reconnected);
	// the middleware reads the record before it acts. stop ends the watch and
	// frees what it holds. An error means the store cannot watch right now; the
	// middleware then polls.
	WatchOutcome(ctx context.Context, scope, key string) (wake <-chan struct{}, stop func(), err error)
	// NotifyOutcome tells every process watching (scope, key) that its holder
	// let go of it: its outcome is stored, or the key was released, or its
	// transaction ended. The middleware calls it after a request that held the
	// key, when Config.InFlightWait is set.
	NotifyOutcome(ctx context.Context, scope, key string) error
}

// WaitOutcome is how a wait for a key's outcome ended (Event.Wait).
type WaitOutcome uint8

// The ways a wait ends.
const (
	// WaitReplayed: the holder's outcome came and was replayed (or, when a
	// different request had stored it, answered 422).
	WaitReplayed WaitOutcome = iota + 1
	// WaitTimedOut: InFlightWait passed first; the request got 409.
	WaitTimedOut
	// WaitHungUp: the client went away while waiting.
	WaitHungUp
	// WaitRetried: the holder let go without an outcome (released, its lease
	// lapsed, its transaction ended), and the request went on as a fresh one.
	WaitRetried
	// WaitFull: InFlightMaxWaiters or InFlightMaxWaitersPerKey was reached; the
	// request got 409 without waiting.
	WaitFull
)

var waitNames = [...]string{"", "replayed", "timed_out", "hung_up", "retried", "full"}

// String returns the outcome's snake_case name.
func (o WaitOutcome) String() string {
	if int(o) < len(waitNames) && o > 0 {
		return waitNames[o]
	}
	return "unknown"
}

// Poll intervals of a prober: from pollFirst, doubling, up to pollMax without
// a notifier; a prober with one re-reads every notifiedMax, in case a
// notification was lost (a reconnect) or a holder crashed without one.
const (
	pollFirst   = 5 * time.Millisecond
	pollMax     = 100 * time.Millisecond
	notifiedMax = time.Second
)

// waiters are the requests of one middleware waiting for outcomes.
type waiters struct {
	m      *middleware
	notify OutcomeNotifier
	mu     sync.Mutex
	total  int
	keys   map[recordID]*keyWait
}

type recordID struct{ scope, key string }

// keyWait is the waiters of one key and their prober.
type keyWait struct {
	id    recordID
	n     int
	cur   *broadcast    // the next broadcast; replaced by each one
	lease time.Time     // the holder's lease deadline, as last read
	kick  chan struct{} // a waiter joined, or the holder here let go: read now
	stop  context.CancelFunc
}

// broadcast wakes the waiters that joined before it: done is closed once rec
// is set (the complete record, or nil: try again).
type broadcast struct {
	done chan struct{}
	rec  *Record
}

// waitJoined, set by tests only, is told the key of each request that
// starts waiting.
var waitJoined func(key string)

func newWaiters(m *middleware) *waiters {
	w := &waiters{m: m, keys: make(map[recordID]*keyWait)}
	w.notify, _ = m.store.(OutcomeNotifier)
	return w
}

// join adds a waiter for id, whose holder's lease runs to lease (zero when
// not known), and returns its group and the broadcast to wait for; ok is false
// when a cap is reached.
func (ws *waiters) join(id recordID, lease time.Time) (kw *keyWait, b *broadcast, ok bool) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	if ws.total >= ws.m.InFlightMaxWaiters {
		return nil, nil, false
	}
	kw = ws.keys[id]
	if kw == nil {
		ctx, cancel := context.WithCancel(context.Background())
		kw = &keyWait{id: id, cur: &broadcast{done: make(chan struct{})}, lease: lease, kick: make(chan struct{}, 1), stop: cancel}
		ws.keys[id] = kw
		go ws.probe(ctx, kw)
	} else if kw.n >= ws.m.InFlightMaxWaitersPerKey {
		return nil, nil, false
	}
	if lease.After(kw.lease) {
		kw.lease = lease
	}
	kw.n++
	ws.total++
	select { // the holder may have let go before this waiter joined: read again
	case kw.kick <- struct{}{}:
	default:
	}
	return kw, kw.cur, true
}

// leave removes a waiter; the last one stops the prober.
func (ws *waiters) leave(kw *keyWait) {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	kw.n--
	ws.total--
	if kw.n == 0 {
		kw.stop()
		delete(ws.keys, kw.id)
	}
}

// leaseOf returns the holder's lease deadline as last read.
func (ws *waiters) leaseOf(kw *keyWait) time.Time {
	ws.mu.Lock()
	defer ws.mu.Unlock()
	return kw.lease
}

// kickKey makes the prober of id, if any, read the record now: the holder in
// this process let go.
func (ws *waiters) kickKey(id recordID) {
	ws.mu.Lock()
	kw := ws.keys[id]
	ws.mu.Unlock()
	if kw != nil {
		select {
		case kw.kick <- struct{}{}:
		default:
		}
	}
}

// wake hands rec (nil: try again) to every waiter that joined so far.
func (ws *waiters) wake(kw *keyWait, rec *Record) {
	ws.mu.Lock()
	b := kw.cur
	kw.cur = &broadcast{done: make(chan struct{})}
	ws.mu.Unlock()
	b.rec = rec
	close(b.done)
}

// probe watches and reads kw's key until its last waiter leaves.
func (ws *waiters) probe(ctx context.Context, kw *keyWait) {
	m := ws.m
	var notified <-chan struct{}
	if ws.notify != nil {
		if wake, stop, err := ws.notify.WatchOutcome(ctx, kw.id.scope, kw.id.key); err == nil {
			defer stop()
			notified = wake
		}
	}
	ceiling := pollMax
	if notified != nil {
		ceiling = notifiedMax
	}
	interval := pollFirst
	timer := time.NewTimer(0) // read once the watch is in place
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-notified:
			interval = pollFirst
		case <-kw.kick:
		case <-timer.C:
			interval = min(2*interval, ceiling)
		}
		if ws.check(ctx, kw) {
			interval = pollFirst
		}
		if ctx.Err() != nil {
			return
		}
		next := interval
		if lease := ws.leaseOf(kw); !lease.IsZero() {
			// Read again just after the lease lapses: a holder that crashed
			// wakes its waiters then.
			next = min(next, max(lease.Sub(m.NowFunc())+time.Millisecond, time.Millisecond))
		}
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		timer.Reset(next)
	}
}

// check reads kw's key once and wakes its waiters when the holder let go; it
// reports whether it did.
func (ws *waiters) check(ctx context.Context, kw *keyWait) bool {
	m := ws.m
	rctx, cancel := context.WithTimeout(ctx, m.CleanupTimeout)
	defer cancel()
	now := m.NowFunc()
	rec, err := m.store.Get(rctx, kw.id.scope, kw.id.key, now)
	switch {
	case err == nil && rec.State == StateComplete:
		ws.wake(kw, rec)
		return true
	case err == nil && rec.LeaseUntil.After(now):
		ws.mu.Lock()
		kw.lease = rec.LeaseUntil
		ws.mu.Unlock()
		return false
	case err == nil: // in flight with a lapsed lease
		ws.wake(kw, nil)
		return true
	case !errors.Is(err, ErrNotFound):
		return false // the store failed: read again later
	}
	// No record. In the single-transaction flow the holder writes none until it
	// commits: the key is free only when its lock is.
	if m.Flow == FlowSingleTx && m.singleTx != nil {
		_, tx, rec, err := m.singleTx.BeginLocked(rctx, kw.id.scope, kw.id.key, now)
		if err != nil {
			return false // still held (ErrInFlight), or the store failed
		}
		_ = tx.Rollback(rctx)
		if rec != nil && rec.State == StateComplete {
			ws.wake(kw, rec)
			return true
		}
	}
	ws.wake(kw, nil)
	return true
}

// awaitOutcome is the answer to a request that found its key in flight, held
// by the same request (as far as is known) until lease (zero: not known, the
// single-transaction flow's lock): with InFlightWait set it waits for the
// holder to let go, and replays its outcome or tries again; otherwise, or when
// the wait ends first, 409.
func (h *handler) awaitOutcome(w http.ResponseWriter, req *request, lease time.Time) {
	left := func(lease time.Time) time.Duration {
		if lease.IsZero() {
			return 0
		}
		return lease.Sub(h.NowFunc())
	}
	if h.waits == nil {
		h.inFlight(w, req, left(lease))
		return
	}
	if req.waitUntil.IsZero() {
		req.waitUntil = time.Now().Add(h.InFlightWait)
	}
	remaining := time.Until(req.waitUntil)
	if remaining <= 0 {
		h.inFlight(w, req, left(lease))
		return
	}
	kw, b, ok := h.waits.join(recordID{req.scope, req.key}, lease)
	if !ok {
		h.observeWait(req, WaitFull, 0)
		h.inFlight(w, req, left(lease))
		return
	}
	if waitJoined != nil {
		waitJoined(req.key)
	}
	start := time.Now()
	timer := time.NewTimer(remaining)
	var outcome WaitOutcome
	select {
	case <-b.done:
		outcome = WaitRetried
		if b.rec != nil {
			outcome = WaitReplayed
		}
	case <-timer.C:
		outcome = WaitTimedOut
	case <-req.r.Context().Done():
		outcome = WaitHungUp
	}
	timer.Stop()
	lease = h.waits.leaseOf(kw)
	h.waits.leave(kw)
	h.observeWait(req, outcome, time.Since(start))
	switch outcome {
	case WaitReplayed:
		if match, _ := sameRequest(req.fp, b.rec.Fingerprint, req.r, req.body); !match {
			h.mismatch(w, req, b.rec)
			return
		}
		h.replay(w, req, b.rec)
	case WaitRetried:
		if h.Flow == FlowSingleTx {
			h.serveSingleTx(w, req)
		} else {
			h.serveClaim(w, req)
		}
	default:
		h.inFlight(w, req, left(lease))
	}
}

func (h *handler) observeWait(req *request, outcome WaitOutcome, waited time.Duration) {
	h.observe(req, Event{Kind: EventWaited, Wait: outcome, Waited: waited})
}

// letGo tells the waiters of req's key that it was let go of: those of this
// middleware at once, those of every process through the store's notifier.
// It runs after a request that held the key, when InFlightWait is set.
func (h *handler) letGo(req *request) {
	if !req.held {
		return
	}
	h.waits.kickKey(recordID{req.scope, req.key})
	if n := h.waits.notify; n != nil {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(req.r.Context()), h.CleanupTimeout)
		scope, key := req.scope, req.key
		go func() { // off the request: its answer is flushed when ServeHTTP returns
			defer cancel()
			_ = n.NotifyOutcome(ctx, scope, key)
		}()
	}
}
