package mysqlstore_test

import (
	"fmt"
	"os"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/waittest"
	"github.com/idemkit/idem/mysqlstore"
)

var waitFlows = []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx}

// pairOfStores returns two stores on one table through pools of their own,
// as two processes would have.
func pairOfStores(t *testing.T) (*mysqlstore.Store, *mysqlstore.Store) {
	t.Helper()
	a := newStore(t, openDB(t, 8, ""))
	b, err := mysqlstore.New(openDB(t, 8, ""), &mysqlstore.Config{Table: a.Table()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	return a, b
}

// TestInFlightWait: 50 requests with one key, the first held a second,
// InFlightWait 5s: one execution, 49 byte-exact replays, no 409 — in one
// middleware, and split over two middlewares with pools of their own (as two
// processes), woken by polling; in both flows.
func TestInFlightWait(t *testing.T) {
	t.Parallel()
	for _, flow := range waitFlows {
		t.Run(fmt.Sprintf("one/flow%d", flow), func(t *testing.T) {
			t.Parallel()
			waittest.Concurrent(t, []idem.Store{newStore(t, openDB(t, 8, ""))}, flow, 50)
		})
		t.Run(fmt.Sprintf("two-pools/flow%d", flow), func(t *testing.T) {
			t.Parallel()
			a, b := pairOfStores(t)
			waittest.Concurrent(t, []idem.Store{a, b}, flow, 50)
		})
	}
}

// TestInFlightWaitShorterThanTheHandler: 409 with Retry-After once
// InFlightWait passes.
func TestInFlightWaitShorterThanTheHandler(t *testing.T) {
	t.Parallel()
	for _, flow := range waitFlows {
		t.Run(fmt.Sprintf("flow%d", flow), func(t *testing.T) {
			t.Parallel()
			waittest.ShortWait(t, newStore(t, openDB(t, 4, "")), flow)
		})
	}
}

// TestInFlightWaitManyWaiters: 2,000 requests wait on one key with a pool of
// 4 connections; another key runs meanwhile.
func TestInFlightWaitManyWaiters(t *testing.T) {
	for _, flow := range waitFlows {
		t.Run(fmt.Sprintf("flow%d", flow), func(t *testing.T) {
			waittest.Many(t, newStore(t, openDB(t, 4, "")), flow, 2000, waittest.Key(t), nil, true)
		})
	}
}

// TestInFlightWaitLatency logs the wake-up latency by hand:
// IDEM_WAIT_LATENCY=1.
func TestInFlightWaitLatency(t *testing.T) {
	if os.Getenv("IDEM_WAIT_LATENCY") == "" {
		t.Skip("set IDEM_WAIT_LATENCY=1 to measure")
	}
	for _, flow := range waitFlows {
		a, b := pairOfStores(t)
		p50, p99 := waittest.WakeLatency(t, []idem.Store{a, b}, flow, 20, 10)
		t.Logf("MariaDB flow %v, two pools: wake-up p50 %v p99 %v", flow, p50, p99)
	}
}
