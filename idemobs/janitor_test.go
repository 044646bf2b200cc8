package idemobs_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/memstore"
)

// panicAlways is a StoreObserver whose StoreStart or StoreDone panics on op,
// every time, and counts what it was told.
type panicAlways struct {
	op      idemobs.Op
	inStart bool
	told    atomic.Int64
}

func (p *panicAlways) StoreStart(ctx context.Context, op idemobs.Op) context.Context {
	if op == p.op && p.inStart {
		p.told.Add(1)
		panic("exporter bug in StoreStart")
	}
	return ctx
}

func (p *panicAlways) StoreDone(_ context.Context, op idemobs.Op, _ time.Duration, _ error) {
	if op == p.op && !p.inStart {
		p.told.Add(1)
		panic("exporter bug in StoreDone")
	}
}

// TestObserverPanicOnJanitorKeepsSweeping: StoreObservers that panic on
// DeleteExpired (one, or several through MultiStore, in StoreStart and in
// StoreDone) run on the janitor's goroutine, where a panic would kill the
// process: every sweep still deletes the expired records and reports to
// OnSweep, and every observer is told of every sweep.
func TestObserverPanicOnJanitorKeepsSweeping(t *testing.T) {
	t.Parallel()
	obs := []*panicAlways{{op: idemobs.OpDeleteExpired, inStart: true}, {op: idemobs.OpDeleteExpired}, {op: idemobs.OpDeleteExpired}}
	for name, o := range map[string]idemobs.StoreObserver{
		"one":   obs[0],
		"multi": idemobs.MultiStore(obs[1], obs[2]),
	} {
		t.Run(name, func(t *testing.T) {
			mem := memstore.New(nil)
			t.Cleanup(func() { _ = mem.Close() })
			ctx, cancel := context.WithCancel(context.Background())
			now := time.Now()
			for _, k := range []string{"a", "b"} {
				if _, _, err := mem.Claim(ctx, idem.ClaimRequest{Scope: "s", Key: k, Token: "t", Now: now.Add(-2 * time.Hour), LeaseUntil: now.Add(-time.Hour), Fingerprint: "f"}); err != nil {
					t.Fatal(err)
				}
				if err := mem.Complete(ctx, "s", k, "t", &idem.Response{Status: 201}, now.Add(-2*time.Hour), now.Add(-time.Hour)); err != nil {
					t.Fatal(err)
				}
			}
			var deleted atomic.Int64
			sweeps := make(chan error, 16)
			j := &idem.Janitor{Store: idemobs.Store(mem, o), Interval: time.Millisecond, OnSweep: func(n int, err error) {
				deleted.Add(int64(n))
				select {
				case sweeps <- err:
				default:
				}
			}}
			done := make(chan error, 1)
			go func() { done <- j.Run(ctx) }()
			for range 3 {
				if err := <-sweeps; err != nil {
					t.Fatalf("sweep: %v", err)
				}
			}
			cancel()
			if err := <-done; !errors.Is(err, context.Canceled) {
				t.Fatalf("Run: %v", err)
			}
			if deleted.Load() != 2 {
				t.Fatalf("deleted %d expired records; want 2", deleted.Load())
			}
		})
	}
	if obs[1].told.Load() < 3 || obs[2].told.Load() < 3 || obs[0].told.Load() < 3 {
		t.Fatalf("observers told of %d, %d, %d sweeps; want every sweep (3 or more) each", obs[0].told.Load(), obs[1].told.Load(), obs[2].told.Load())
	}
}
