package pgstore

import (
	"context"
	"testing"
)

// TestDeadSessionChecksAllocateNothingOnSuccess: every round trip of the hot
// path (a claim, BeginLocked, a read of the record, a completion on the pool)
// asks retryDead or idleSessionEnded about its answer; a successful one (nil)
// must cost no allocation. Their errors.As targets escape to the heap, and
// were allocated on every call, nil error included (2 + 1 allocations per
// round trip).
func TestDeadSessionChecksAllocateNothingOnSuccess(t *testing.T) {
	s := &Store{}
	ctx := context.Background()
	if n := testing.AllocsPerRun(100, func() {
		if s.retryDead(ctx, nil, 0) {
			t.Fatal("retryDead(nil) = true")
		}
	}); n != 0 {
		t.Errorf("retryDead(nil): %v allocations, want 0", n)
	}
	if n := testing.AllocsPerRun(100, func() {
		if idleSessionEnded(nil) {
			t.Fatal("idleSessionEnded(nil) = true")
		}
	}); n != 0 {
		t.Errorf("idleSessionEnded(nil): %v allocations, want 0", n)
	}
}
