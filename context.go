package idem

import (
	"context"
	"sync"
	"time"
)

// handlerContext is the context the handler of a claimed request sees: the
// request's context, cancellable when the lease is lost, that also answers
// recorderKey with the request's recorder (for SetRef and KeyFrom). It lives
// inside the request struct, so it costs no allocation of its own.
type handlerContext struct {
	context.Context
	rw *recorder
}

// Value returns the recorder for recorderKey and delegates everything else.
func (c *handlerContext) Value(key any) any {
	if key == (recorderKey{}) {
		return c.rw
	}
	return c.Context.Value(key)
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
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer != nil {
		c.timer.Stop()
	}
	c.values, c.deadline = values, time.Now().Add(timeout)
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
		if d := time.Until(c.deadline); d <= 0 {
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
