package redisstore_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/steptest"
)

// TestStepStore runs the step-record checks against Redis, each check under a
// key prefix of its own.
func TestStepStore(t *testing.T) {
	t.Parallel()
	steptest.Run(t, func(t *testing.T) steptest.Store { return setup(t).store }, steptest.Options{NoDeleteExpired: true})
}

// TestStepsExpireInRedis: a step record's hash and the operation's index of
// steps share the record's hash slot (one script touches them and the record
// on Redis Cluster); the hash carries a Redis expiry of its ExpiresAt − Now,
// raised by a BeginStep that moves it later and never lowered, the index
// that of the latest step; and they are gone when that time is up.
func TestStepsExpireInRedis(t *testing.T) {
	t.Parallel()
	b := setup(t)
	ctx := context.Background()
	now := time.Now()
	begin := func(name string, expires time.Duration) {
		t.Helper()
		if _, _, err := b.store.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: "k", Name: name, Owner: "o",
			DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(expires)}); err != nil {
			t.Fatal(err)
		}
	}
	begin("a", time.Hour)
	rec := b.prefix + "{cw.aw}" // recordKey("s", "k")
	keys := keysUnder(t, b.client, b.prefix)
	slices.Sort(keys)
	if want := []string{rec + ":step:a", rec + ":steps"}; !slices.Equal(keys, want) {
		t.Fatalf("keys under the prefix: %q, want %q", keys, want)
	}
	for _, k := range keys {
		slotA, errA := b.client.ClusterKeySlot(ctx, k).Result()
		slotB, errB := b.client.ClusterKeySlot(ctx, rec).Result()
		if errA == nil && errB == nil && slotA != slotB {
			t.Fatalf("%s in slot %d, its record in %d", k, slotA, slotB)
		}
	}
	pttl := func(k string) time.Duration {
		d, err := b.client.PTTL(ctx, k).Result()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if d := pttl(rec + ":step:a"); d < 59*time.Minute || d > time.Hour {
		t.Fatalf("PTTL %v, want about an hour", d)
	}
	begin("a", 2*time.Hour) // moves a's expiry later
	begin("b", 3*time.Hour)
	begin("b", time.Minute) // never lowered
	if d := pttl(rec + ":step:a"); d < 119*time.Minute || d > 2*time.Hour {
		t.Fatalf("PTTL of a after a later expiry %v, want about two hours", d)
	}
	if d := pttl(rec + ":step:b"); d < 179*time.Minute {
		t.Fatalf("PTTL of b %v, want about three hours", d)
	}
	if d := pttl(rec + ":steps"); d < 179*time.Minute {
		t.Fatalf("PTTL of the index %v, want about three hours", d)
	}
	// A short-lived operation: gone from Redis when its time is up.
	if _, _, err := b.store.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: "short", Name: "a", Owner: "o",
		DerivedKey: "idem_x", Now: time.Now(), ExpiresAt: time.Now().Add(200 * time.Millisecond)}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(keysUnder(t, b.client, b.prefix)) != 3 {
		if time.Now().After(deadline) {
			t.Fatalf("the short-lived step's keys are still there: %v", keysUnder(t, b.client, b.prefix))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// BenchmarkStep: a step's first BeginStep (fenced), FinishStep and a replay's
// BeginStep, per op.
func BenchmarkStep(b *testing.B) {
	steptest.Bench(b, setup(b).store)
}

// TestStepHTTP: idem.Step in a handler over loopback HTTP records the step,
// and the retry after an answer not kept gets the recorded result without
// calling the provider again (steptest.HTTP; Redis has no transaction).
func TestStepHTTP(t *testing.T) {
	t.Parallel()
	steptest.HTTP(t, setup(t).store, idem.FlowClaimComplete, func(context.Context) error { return nil })
}
