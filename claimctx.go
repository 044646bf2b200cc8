package idem

import (
	"context"
	"time"
)

// claimContext starts the context of req's claim, embedded in the request:
// the request's values, not its cancellation, ending timeout after wall (a
// wall clock reading for now) — what context.WithTimeout(context.WithoutCancel(ctx), timeout)
// gives, without its five allocations and its timer, which are made only if
// the store asks for Done. Call endClaimContext once the claim returned. A
// request that claims twice (a lapsed claim under an older fingerprint
// version) gets a context of the context package the second time, so that a
// context the first claim handed on is never started afresh.
func (req *request) claimContext(wall time.Time, timeout time.Duration) (context.Context, context.CancelFunc) {
	if req.claimCtxUsed {
		return context.WithTimeout(context.WithoutCancel(req.r.Context()), timeout)
	}
	req.claimCtxUsed = true
	req.claimCtx.resetAt(req.r.Context(), wall, timeout)
	return &req.claimCtx, nil
}

// endClaimContext ends the claim's context as cancel would: a store that kept it
// past the call sees context.Canceled.
func (req *request) endClaimContext(cancel context.CancelFunc) {
	if cancel != nil {
		cancel()
		return
	}
	req.claimCtx.cancel()
}

// cancel ends the context with context.Canceled, unless it ended already, and
// releases its timer.
func (c *cleanupContext) cancel() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer != nil {
		c.timer.Stop()
	}
	if c.err == nil {
		c.err = context.Canceled
		if c.done != nil {
			close(c.done)
		}
	}
}

// wallAt returns a wall clock reading for now, given now, a reading of
// NowFunc: the same reading when NowFunc is time.Now (one clock reading
// instead of two), time.Now otherwise.
func (h *handler) wallAt(now time.Time) time.Time {
	if h.wallClock {
		return now
	}
	return time.Now()
}

// recordTime returns a reading of NowFunc for now, given wall, a wall clock
// reading: wall itself when NowFunc is time.Now.
func (h *handler) recordTime(wall time.Time) time.Time {
	if h.wallClock {
		return wall
	}
	return h.NowFunc()
}
