package bench

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"
)

// TestOverheadRun runs the overhead measurement with this test binary as the
// server and the loader processes (see TestMain): every cell must pass its
// checks, the server's CPU, allocations and peak RSS must be measured in the
// server's process (not the loader's), and the replays must have inserted no
// row.
func TestOverheadRun(t *testing.T) {
	t.Parallel()
	rep, err := RunOverhead(context.Background(), OverheadConfig{
		Concurrency: []int{1, 3}, Rounds: 2, Duration: 120 * time.Millisecond, Warmup: 20 * time.Millisecond, ReplayKeys: 16,
		ServerCommand: []string{os.Args[0]}, LoaderCommand: []string{os.Args[0]},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Cells) != 12 {
		t.Fatalf("%d cells; want 2 targets × 3 variants × 2 concurrencies", len(rep.Cells))
	}
	for _, c := range rep.Cells {
		if c.Check != "" {
			t.Errorf("%s %s c=%d: %s", c.Target, c.Variant, c.Concurrency, c.Check)
		}
		if c.Requests <= 0 || c.ServerCPUMicros <= 0 || c.Allocs <= 0 || c.PeakRSSMiB <= 0 {
			t.Errorf("%s %s c=%d: %d requests, %.1f µs server CPU, %.1f allocs, %.1f MiB per request; want all measured", c.Target, c.Variant, c.Concurrency, c.Requests, c.ServerCPUMicros, c.Allocs, c.PeakRSSMiB)
		}
		if c.Variant != VariantBaseline && len(c.RoundExtra) != 2 {
			t.Errorf("%s %s c=%d: %d per-round figures; want 2", c.Target, c.Variant, c.Concurrency, len(c.RoundExtra))
		}
		if c.Variant == VariantReplay && (c.rows != 0 || c.replayed != c.Requests) {
			t.Errorf("%s replay c=%d: %d rows, %d of %d replayed; want every answer a replay", c.Target, c.Concurrency, c.rows, c.replayed, c.Requests)
		}
		if c.Variant == VariantFirst && (c.rows != c.Requests || c.executed != c.Requests) {
			t.Errorf("%s first c=%d: %d rows, %d executed for %d requests", c.Target, c.Concurrency, c.rows, c.executed, c.Requests)
		}
	}
	var md bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"| memory | first | 3 |", "| fiber | replay | 1 |", "| clients | idem first | Fiber first |"} {
		if !strings.Contains(md.String(), s) {
			t.Errorf("markdown lacks %q:\n%s", s, md.String())
		}
	}
}
