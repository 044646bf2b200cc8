package redisstore_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/internal/waittest"
	"github.com/idemkit/idem/redisstore"
	"github.com/redis/go-redis/v9"
)

// secondStore opens b's prefix through a Redis client of its own, as another
// process would.
func secondStore(t *testing.T, b *testBundle) *redisstore.Store {
	t.Helper()
	opts, err := redis.ParseURL(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	client := redis.NewClient(opts)
	t.Cleanup(func() { _ = client.Close() })
	s, err := redisstore.New(client, &redisstore.Config{Prefix: b.prefix})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestInFlightWait: 50 requests with one key, the first held a second,
// InFlightWait 5s: one execution, 49 byte-exact replays, no 409 — in one
// middleware, and split over two middlewares with clients of their own (as
// two processes), woken by pub/sub.
func TestInFlightWait(t *testing.T) {
	t.Parallel()
	t.Run("one", func(t *testing.T) {
		t.Parallel()
		waittest.Concurrent(t, []idem.Store{setup(t).store}, idem.FlowAuto, 50)
	})
	t.Run("two-clients", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		waittest.Concurrent(t, []idem.Store{b.store, secondStore(t, b)}, idem.FlowAuto, 50)
	})
}

// TestInFlightWaitShorterThanTheHandler: 409 with Retry-After once
// InFlightWait passes.
func TestInFlightWaitShorterThanTheHandler(t *testing.T) {
	t.Parallel()
	waittest.ShortWait(t, setup(t).store, idem.FlowAuto)
}

// TestInFlightWaitManyWaiters: 2,000 requests wait on one key; another key
// runs meanwhile.
func TestInFlightWaitManyWaiters(t *testing.T) {
	waittest.Many(t, setup(t).store, idem.FlowAuto, 2000, waittest.Key(t), nil, true)
}

// TestOutcomeNotifierAcrossClients: a notification published through one
// client wakes a watch of another, and only the watch of its key.
func TestOutcomeNotifierAcrossClients(t *testing.T) {
	t.Parallel()
	b := setup(t)
	other := secondStore(t, b)
	ctx := context.Background()
	wake, stop, err := b.store.WatchOutcome(ctx, "tenant", "k1")
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	k2, stop2, err := b.store.WatchOutcome(ctx, "tenant", "k2")
	if err != nil {
		t.Fatal(err)
	}
	defer stop2()
	if err := other.NotifyOutcome(ctx, "tenant", "k1"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-wake:
	case <-time.After(time.Minute):
		t.Fatal("no notification a minute after NotifyOutcome through another client")
	}
	select {
	case <-k2:
		t.Error("a watch of another key was woken")
	default:
	}
}

// TestInFlightWaitLatency logs the wake-up latency by hand:
// IDEM_WAIT_LATENCY=1.
func TestInFlightWaitLatency(t *testing.T) {
	if os.Getenv("IDEM_WAIT_LATENCY") == "" {
		t.Skip("set IDEM_WAIT_LATENCY=1 to measure")
	}
	b := setup(t)
	p50, p99 := waittest.WakeLatency(t, []idem.Store{b.store, secondStore(t, b)}, idem.FlowAuto, 20, 10)
	t.Logf("Redis, two clients: wake-up p50 %v p99 %v", p50, p99)
}
