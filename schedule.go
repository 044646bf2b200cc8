package idem

import (
	"context"
	"errors"
	"sync"
	"time"
)

// The scheduler: lease renewal and HandlerTimeout for every running handler of
// a middleware, on one ticker.

// handlerDeadline returns when a handler starting now must end (HandlerTimeout),
// on the wall clock, or the zero time for none.
func (h *handler) handlerDeadline() time.Time {
	if h.HandlerTimeout <= 0 {
		return time.Time{}
	}
	return h.handlerDeadlineAt(time.Now())
}

// handlerDeadlineAt is handlerDeadline with wall, a wall clock reading, for now.
func (h *handler) handlerDeadlineAt(wall time.Time) time.Time {
	if h.HandlerTimeout <= 0 {
		return time.Time{}
	}
	return wall.Add(h.HandlerTimeout)
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
	req.startTimerAt(token, renew, time.Now())
}

// startTimerAt is startTimer with wall, a wall clock reading, for now.
func (req *request) startTimerAt(token string, renew bool, wall time.Time) {
	req.mu.Lock()
	req.token, req.renew = token, renew
	if req.deadlineOf == nil {
		req.deadlineOf = &req.exec
	}
	req.nextRenew = wall.Add(req.h.Lease / 3)
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
