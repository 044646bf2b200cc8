package pgoutbox

import (
	"context"
	"testing"
)

// TestRetryDeadAllocatesNothingOnSuccess: each Lease, MarkPublished, Retry
// and DeadLetter asks retryDead about its answer; a successful one (nil) must
// cost no allocation. Its errors.As targets escape to the heap, and were
// allocated on every call, nil error included.
func TestRetryDeadAllocatesNothingOnSuccess(t *testing.T) {
	o := &Outbox{}
	ctx := context.Background()
	if n := testing.AllocsPerRun(100, func() {
		if o.retryDead(ctx, nil, 0) {
			t.Fatal("retryDead(nil) = true")
		}
	}); n != 0 {
		t.Errorf("retryDead(nil): %v allocations, want 0", n)
	}
}
