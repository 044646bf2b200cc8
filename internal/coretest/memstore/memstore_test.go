package memstore_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/storetest"
)

var _ idem.Store = memstore.New(&memstore.Config{JanitorInterval: -1})

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idem.Store {
		s := memstore.New(nil)
		t.Cleanup(func() { _ = s.Close() })
		return s
	})
}

// The janitor sweeps by the middleware's clock, not its own: with the
// middleware's clock two minutes behind the wall clock and a one-minute TTL, a
// live claim survives the sweeps (regression: the janitor used time.Now and
// deleted it, and a second request ran the handler).
func TestJanitorFollowsTheMiddlewareClock(t *testing.T) {
	t.Parallel()
	s := memstore.New(&memstore.Config{JanitorInterval: 5 * time.Millisecond})
	t.Cleanup(func() { _ = s.Close() })
	behind := time.Now().Add(-2 * time.Minute)
	ctx := context.Background()
	req := idem.ClaimRequest{Scope: "s", Key: "k", Fingerprint: "v2:x", Token: "t",
		Now: behind, LeaseUntil: behind.Add(30 * time.Second), ExpiresAt: behind.Add(time.Minute)}
	if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
		t.Fatalf("claim: %v %v", claimed, err)
	}
	time.Sleep(60 * time.Millisecond) // a dozen sweeps
	if _, err := s.Get(ctx, "s", "k", behind.Add(time.Second)); err != nil {
		t.Fatalf("the live claim is gone after the janitor's sweeps: %v", err)
	}
	// Once the middleware's clock passes the expiry, the janitor deletes it.
	later := behind.Add(2 * time.Minute)
	if err := s.Extend(ctx, "other", "k", "t", later, later.Add(time.Second)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("extend of an absent record: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for s.Len() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the expired record was never swept")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestJanitorFollowsAClockThatWentBack: the janitor sweeps by the middleware's
// latest clock reading, and a clock that jumped a year ahead once (a wrong
// clock at boot that NTP corrected) must not leave the janitor a year ahead:
// records written after the clock came back, live by it, must survive the
// sweeps (regression: the janitor kept the highest reading ever seen and
// deleted every record at its next sweep, so every retry ran the handler again).
func TestJanitorFollowsAClockThatWentBack(t *testing.T) {
	t.Parallel()
	s := memstore.New(&memstore.Config{JanitorInterval: 5 * time.Millisecond})
	t.Cleanup(func() { _ = s.Close() })
	ctx := context.Background()
	now := time.Now()
	// Readings: a year ahead, then back (Extend of an absent record only reads the clock).
	for _, at := range []time.Time{now.AddDate(1, 0, 0), now} {
		if err := s.Extend(ctx, "other", "k", "t", at, at.Add(time.Second)); !errors.Is(err, idem.ErrLockLost) {
			t.Fatalf("extend of an absent record: %v", err)
		}
	}
	claim := func(key string, expires time.Time) {
		t.Helper()
		req := idem.ClaimRequest{Scope: "s", Key: key, Fingerprint: "v2:x", Token: "t-" + key,
			Now: now, LeaseUntil: now.Add(time.Second), ExpiresAt: expires}
		if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
			t.Fatalf("claim %s: %v %v", key, claimed, err)
		}
		if err := s.Complete(ctx, "s", key, "t-"+key, &idem.Response{Status: 201}, now, expires); err != nil {
			t.Fatalf("complete %s: %v", key, err)
		}
	}
	claim("live", now.Add(time.Hour))
	claim("sentinel", now.Add(2*time.Second))
	// The clock moves on three seconds: the sentinel expires, the live record does not.
	later := now.Add(3 * time.Second)
	if err := s.Extend(ctx, "other", "k", "t", later, later.Add(time.Second)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("extend of an absent record: %v", err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		if _, err := s.Get(ctx, "s", "sentinel", now); errors.Is(err, idem.ErrNotFound) {
			break // a sweep ran after the last reading
		}
		if time.Now().After(deadline) {
			t.Fatal("the expired sentinel was never swept")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if _, err := s.Get(ctx, "s", "live", later); err != nil {
		t.Fatalf("the record live by the middleware's clock was swept: %v (the janitor ran on the clock's old jump)", err)
	}
}

// The janitor deletes expired step records too, after the records, and leaves
// live ones (issue 27).
func TestJanitorDeletesExpiredSteps(t *testing.T) {
	t.Parallel()
	s := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = s.Close() })
	ctx := context.Background()
	now := time.Now()
	for i, ttl := range []time.Duration{time.Second, time.Second, time.Hour} {
		req := idem.BeginStepRequest{Scope: "s", Key: "k", Name: string(rune('a' + i)), Owner: "o", DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(ttl)}
		if _, began, err := s.BeginStep(ctx, req); err != nil || !began {
			t.Fatalf("BeginStep: %v %v", began, err)
		}
	}
	j := &idem.Janitor{Store: s, BatchSize: 1, NowFunc: func() time.Time { return now.Add(time.Minute) }}
	n, err := j.Sweep(ctx)
	if err != nil || n != 2 {
		t.Fatalf("Sweep = %d, %v; want the 2 expired step records", n, err)
	}
	if s.StepLen() != 1 {
		t.Fatalf("%d step records left, want the live one", s.StepLen())
	}
}
