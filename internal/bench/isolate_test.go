package bench

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testenv"
)

// isolatedConfig runs this test binary as the server process (see TestMain).
func isolatedConfig(stores ...string) Config {
	return Config{
		Stores: stores, Duration: 90 * time.Millisecond, Rounds: 1, Concurrency: []int{2}, ReplayKeys: 8,
		Isolate: true, ServerCommand: []string{os.Args[0]}, MemoryRecords: -1,
	}
}

// TestIsolatedRun runs memstore and Fiber in server processes of their own: the
// cells must pass their checks, and the server's CPU and allocations must be
// measured there (the load generator's process does not serve).
func TestIsolatedRun(t *testing.T) {
	t.Parallel()
	cfg := isolatedConfig("memory")
	cfg.Fiber, cfg.MemoryRecords = true, 400
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.Isolated || len(rep.Results) != 8 {
		t.Fatalf("isolated %v, %d results; want an isolated run of 8 cells", rep.Isolated, len(rep.Results))
	}
	for _, r := range rep.Results {
		if r.Check != "" {
			t.Errorf("%s %s: %s", r.Target, r.Variant, r.Check)
		}
		if r.ServerCPUMicros <= 0 || r.Allocs <= 0 || r.LoaderBusy < 0 {
			t.Errorf("%s %s: server CPU %.1f µs, %.0f allocs, loader %.2f per request; want them measured", r.Target, r.Variant, r.ServerCPUMicros, r.Allocs, r.LoaderBusy)
		}
		if r.RoundTrips != -1 || r.DBCPUMicros != -1 {
			t.Errorf("%s %s: %v round trips, %v DB CPU; want not measured (-1) without a database", r.Target, r.Variant, r.RoundTrips, r.DBCPUMicros)
		}
	}
	if len(rep.Memory) != 4 {
		t.Fatalf("%d memory results; want 4", len(rep.Memory))
	}
	for _, m := range rep.Memory {
		if m.Check != "" || m.Records != 400 || m.PeakRSSKiB <= 0 {
			t.Errorf("memory %s %s: %+v", m.Target, m.Variant, m)
		}
	}
}

// TestIsolatedPostgresCounts checks the round trips and statements counted on
// the server's connections: the bare handler's autocommit INSERT is one of each,
// the hand-written reference's first-time request three round trips and six
// statements. A connection's first use of a statement costs one more round trip
// (pgx prepares it), hence the margin on round trips.
func TestIsolatedPostgresCounts(t *testing.T) {
	t.Parallel()
	cfg := isolatedConfig("postgres")
	cfg.PostgresURL, cfg.Duration = testenv.PostgresURL(t), 300*time.Millisecond
	rep, err := Run(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, r := range rep.Results {
		seen[r.Variant] = true
		if r.Check != "" {
			t.Errorf("%s: %s", r.Variant, r.Check)
		}
		switch r.Variant {
		case VariantBaseline:
			if r.RoundTrips < 1 || r.RoundTrips >= 1.5 || r.Statements != 1 {
				t.Errorf("baseline: %.2f round trips, %.2f statements per request; want 1, 1", r.RoundTrips, r.Statements)
			}
		case VariantHand:
			if r.RoundTrips < 3 || r.RoundTrips >= 3.5 || r.Statements != 6 {
				t.Errorf("hand-written: %.2f round trips, %.2f statements per request; want 3, 6", r.RoundTrips, r.Statements)
			}
		}
	}
	for _, v := range []string{VariantBaseline, VariantFirst, VariantClaim, VariantSingleTx, VariantHand, VariantReplay, VariantHot} {
		if !seen[v] {
			t.Errorf("no %s cell", v)
		}
	}
}
