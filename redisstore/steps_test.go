package redisstore_test

import (
	"context"
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

// TestStepsExpireInRedis: the hash of a record's steps shares the record's
// hash slot (one script touches both on Redis Cluster), carries a Redis
// expiry of the steps' latest ExpiresAt − Now, raised by a later BeginStep
// and never lowered, and is gone when that time is up.
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
	keys := keysUnder(t, b.client, b.prefix)
	if len(keys) != 1 {
		t.Fatalf("keys under the prefix: %v, want the steps hash", keys)
	}
	rec := b.prefix + "{cw.aw}" // recordKey("s", "k")
	if keys[0] != rec+":steps" {
		t.Fatalf("steps key %q, want %q", keys[0], rec+":steps")
	}
	slotA, errA := b.client.ClusterKeySlot(ctx, keys[0]).Result()
	slotB, errB := b.client.ClusterKeySlot(ctx, rec).Result()
	if errA == nil && errB == nil && slotA != slotB {
		t.Fatalf("steps hash in slot %d, its record in %d", slotA, slotB)
	}
	pttl := func() time.Duration {
		d, err := b.client.PTTL(ctx, keys[0]).Result()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if d := pttl(); d < 59*time.Minute || d > time.Hour {
		t.Fatalf("PTTL %v, want about an hour", d)
	}
	begin("b", 2*time.Hour)
	if d := pttl(); d < 119*time.Minute {
		t.Fatalf("PTTL after a later step %v, want about two hours", d)
	}
	begin("c", time.Minute)
	if d := pttl(); d < 119*time.Minute {
		t.Fatalf("PTTL after an earlier step %v: lowered", d)
	}
	// A short-lived operation: gone from Redis when its time is up.
	if _, _, err := b.store.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: "short", Name: "a", Owner: "o",
		DerivedKey: "idem_x", Now: time.Now(), ExpiresAt: time.Now().Add(200 * time.Millisecond)}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(keysUnder(t, b.client, b.prefix)) != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("the short-lived steps hash is still there: %v", keysUnder(t, b.client, b.prefix))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
