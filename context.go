package idem

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"
)

// execContext is the context the handler of a claimed request sees. It carries
// the request's values but not the client's cancellation: a claimed operation
// runs to its end whatever the client does. It ends at its own deadline
// (Config.HandlerTimeout; Err is then context.DeadlineExceeded) or when the lease
// is lost (Err is context.Canceled, and context.Cause is ErrLockLost), both
// signalled by the request's one timer. It also answers recorderKey with the
// request's recorder (for SetRef and KeyFrom).
//
// Its cancellation lives in inner, a cancel context of the context package, so
// that context.Cause and contexts derived by the handler work as usual: Value
// asks inner first, which answers the context package's own lookups. inner is
// made on first use (Done, Value, or Err after the end), so that a handler that
// never looks at its context costs no cancel context; an end before that is
// kept in ended and cause and applied when inner is made.
type execContext struct {
	values   context.Context
	deadline time.Time // zero: none
	rw       *recorder

	ready  atomic.Bool // inner is made; set after inner and cancel
	mu     sync.Mutex  // guards the fields below until ready
	inner  context.Context
	cancel context.CancelCauseFunc
	ended  bool  // end was called before inner was made
	cause  error // the first end's cause
}

func (c *execContext) init(values context.Context, deadline time.Time, rw *recorder) {
	c.values, c.deadline, c.rw = values, deadline, rw
	c.ready.Store(false)
	c.inner, c.cancel, c.ended, c.cause = nil, nil, false, nil
}

// ctx returns inner, making it (cancelled already if the context ended) on
// first use.
func (c *execContext) ctx() context.Context {
	if c.ready.Load() {
		return c.inner
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.inner == nil {
		c.inner, c.cancel = context.WithCancelCause(context.Background())
		if c.ended {
			c.cancel(c.cause)
		}
		c.ready.Store(true)
	}
	return c.inner
}

// Deadline returns the HandlerTimeout deadline, if there is one.
func (c *execContext) Deadline() (time.Time, bool) { return c.deadline, !c.deadline.IsZero() }

// Done is closed at the deadline or when the lease is lost.
func (c *execContext) Done() <-chan struct{} { return c.ctx().Done() }

// Err is context.DeadlineExceeded after the deadline, context.Canceled after the
// lease was lost, nil before.
func (c *execContext) Err() error {
	if !c.ready.Load() {
		c.mu.Lock()
		ended := c.ended || c.inner != nil
		c.mu.Unlock()
		if !ended {
			return nil // the fast path of drivers that poll Err
		}
	}
	inner := c.ctx()
	err := inner.Err()
	if err != nil && errors.Is(context.Cause(inner), context.DeadlineExceeded) {
		return context.DeadlineExceeded
	}
	return err
}

// Value answers recorderKey with the recorder, the context package's own keys
// from inner, and everything else from the request's context.
func (c *execContext) Value(key any) any {
	if key == (recorderKey{}) {
		return c.rw
	}
	if v := c.ctx().Value(key); v != nil {
		return v
	}
	return c.values.Value(key)
}

// end cancels the context with cause; the first cause stays.
func (c *execContext) end(cause error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.inner != nil {
		c.cancel(cause)
		return
	}
	if !c.ended {
		c.ended, c.cause = true, cause
	}
}

// lockLost reports whether the context ended because the lease was lost.
func (c *execContext) lockLost() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.inner != nil {
		return errors.Is(context.Cause(c.inner), ErrLockLost)
	}
	return c.ended && errors.Is(c.cause, ErrLockLost)
}

// cleanupContext is the context for the store calls made after the handler
// returned (complete, commit, release). It carries the request's values but not
// its cancellation — a client that hangs up must not stop the outcome from being
// stored — and ends at a fixed deadline on the wall clock (never Config.NowFunc,
// which is for record times). Its Done channel and timer are made only when a
// store asks for them, so stores that never wait on Done pay nothing. reset
// starts it afresh for a later phase of the same request.
type cleanupContext struct {
	values   context.Context
	deadline time.Time
	mu       sync.Mutex
	done     chan struct{}
	timer    *time.Timer
	err      error
	gen      uint64 // bumped by reset; a timer of an earlier phase does nothing
}

// reset starts the context afresh: values from values, ending timeout from now.
func (c *cleanupContext) reset(values context.Context, timeout time.Duration) {
	c.resetAt(values, time.Now(), timeout)
}

// resetAt is reset with now, a wall clock reading, for the current time.
func (c *cleanupContext) resetAt(values context.Context, now time.Time, timeout time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer != nil {
		c.timer.Stop()
	}
	c.values, c.deadline = values, now.Add(timeout)
	c.done, c.timer, c.err = nil, nil, nil
	c.gen++
}

// Deadline returns the fixed deadline.
func (c *cleanupContext) Deadline() (time.Time, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.deadline, true
}

// Done returns a channel closed at the deadline.
func (c *cleanupContext) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.done == nil {
		c.done = make(chan struct{})
		if c.err != nil {
			close(c.done) // cancelled before anyone asked
		} else if d := time.Until(c.deadline); d <= 0 {
			c.expireLocked()
		} else {
			gen := c.gen
			c.timer = time.AfterFunc(d, func() { c.expire(gen) })
		}
	}
	return c.done
}

func (c *cleanupContext) expire(gen uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.gen == gen {
		c.expireLocked()
	}
}

func (c *cleanupContext) expireLocked() {
	if c.err == nil {
		c.err = context.DeadlineExceeded
		if c.done == nil {
			c.done = make(chan struct{})
		}
		close(c.done)
	}
}

// Err returns context.DeadlineExceeded once the deadline has passed.
func (c *cleanupContext) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err == nil && !time.Now().Before(c.deadline) {
		c.expireLocked()
	}
	return c.err
}

// Value delegates to the request's context.
func (c *cleanupContext) Value(key any) any {
	c.mu.Lock()
	values := c.values
	c.mu.Unlock()
	return values.Value(key)
}

// stop releases the timer, if one was made.
func (c *cleanupContext) stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer != nil {
		c.timer.Stop()
	}
}
