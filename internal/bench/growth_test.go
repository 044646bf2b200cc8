package bench

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testenv"
)

// TestGrowthSmall runs the growth benchmark at a few thousand records: the
// steps, the sizes, the janitor's sweep of the expired oldest records, the
// VACUUM, the refill, and the tables dropped at the end.
func TestGrowthSmall(t *testing.T) {
	url := testenv.PostgresURL(t)
	statsWait = 0 // not parallel: the only test that sets it
	t.Cleanup(func() { statsWait = 11 * time.Second })
	suffix := fmt.Sprintf("t%d", time.Now().UnixNano())
	cfg := Config{Stores: []string{}, Growth: true, GrowthSizes: []int{2000, 6000}, GrowthClaims: 20, JanitorBacklog: 3000, PostgresURL: url,
		GrowthChunk: 1500} // several chunks per step, the last one short
	cfg.defaults()
	ctx := context.Background()
	g, err := runGrowth(ctx, &cfg, suffix)
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Steps) != 2 {
		t.Fatalf("%d steps; want 2", len(g.Steps))
	}
	for _, s := range g.Steps {
		if s.Claims != 20 || s.LoadRate <= 0 || s.Sizes.HeapMB <= 0 || s.Sizes.TotalMB < s.Sizes.HeapMB+s.Sizes.IndexMB {
			t.Errorf("step %d: %+v", s.Records, s)
		}
		if len(s.Sizes.Indexes) != 2 || s.Sizes.Indexes[0].Name != "idem_records_pkey" || s.Sizes.Indexes[1].Name != "idem_records_expires_at_idx" {
			t.Errorf("step %d: indexes %+v; want idem_records_pkey, idem_records_expires_at_idx", s.Records, s.Sizes.Indexes)
		}
	}
	if !strings.Contains(g.Loader, "the server's autovacuum is ") {
		t.Errorf("loader %q does not say whether the server's autovacuum is on", g.Loader)
	}
	j := g.Janitor
	if j == nil {
		t.Fatal("no janitor step")
	}
	if j.Records != 6000 || j.Backlog != 3000 || j.Deleted != 3000 || j.Refill != 3000 {
		t.Errorf("janitor: records %d, backlog %d, deleted %d, refill %d; want 6000, 3000, 3000, 3000", j.Records, j.Backlog, j.Deleted, j.Refill)
	}
	if j.AutovacuumTrigger < 10000 || j.Autovacuum != Autovacuum {
		t.Errorf("janitor: autovacuum %q starting at %d dead rows; want %q, at least its threshold 10000", j.Autovacuum, j.AutovacuumTrigger, Autovacuum)
	}
	if j.Before.HeapMB <= 0 || j.AfterVacuum.HeapMB <= 0 || j.AfterRefill.HeapMB < j.AfterVacuum.HeapMB {
		t.Errorf("janitor sizes: before %+v, after the vacuum %+v, after the refill %+v", j.Before, j.AfterVacuum, j.AfterRefill)
	}
	if j.FreePercent != -1 && (j.FreePercent <= 0 || j.FreePercent > 100) {
		t.Errorf("free %.1f%% of the heap after deleting half the records; want between 0 and 100", j.FreePercent)
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var left int
	if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_class WHERE relname LIKE '%growth%' || $1 || '%'", suffix).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Errorf("%d tables of the run left behind", left)
	}
}

// TestGrowthBudget: a size whose projected load does not fit the budget is not
// loaded, and the report says so.
func TestGrowthBudget(t *testing.T) {
	t.Parallel()
	cfg := Config{Stores: []string{}, Growth: true, GrowthSizes: []int{1000, 50_000_000}, GrowthClaims: 5, JanitorBacklog: -1,
		GrowthBudget: time.Minute, PostgresURL: testenv.PostgresURL(t)}
	cfg.defaults()
	g, err := runGrowth(context.Background(), &cfg, fmt.Sprintf("b%d", time.Now().UnixNano()))
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Steps) != 1 || g.Steps[0].Records != 1000 {
		t.Fatalf("steps %+v; want only 1000 records", g.Steps)
	}
	if !strings.Contains(g.Note, "50M records not loaded") || !strings.Contains(g.Note, "--growth-budget") {
		t.Errorf("note %q does not say 50M records were not loaded for the budget", g.Note)
	}
}

// TestGrowthMarkdown: the growth tables give each index's size, the sizes per
// million records and the bloat the janitor left.
func TestGrowthMarkdown(t *testing.T) {
	t.Parallel()
	ix := func(pk, ex float64) []IndexSize {
		return []IndexSize{{Name: "idem_records_pkey", MB: pk}, {Name: "idem_records_expires_at_idx", MB: ex}}
	}
	rep := &Report{Growth: &GrowthReport{
		Version: "PostgreSQL 15", RefRecords: 10_000, Loader: "COPY",
		Steps: []GrowthStep{
			{Records: 10_000, LoadSeconds: 0.2, LoadRate: 50000, Claims: 3, TableMB: 4, Sizes: Sizes{HeapMB: 3, IndexMB: 1, TotalMB: 4, Indexes: ix(0.8, 0.2)}},
			{Records: 2_000_000, LoadSeconds: 40, LoadRate: 50000, Claims: 3, P50Micros: 150, P99Micros: 900, TableMB: 900,
				Sizes: Sizes{HeapMB: 660, IndexMB: 200, TotalMB: 900, Indexes: ix(160, 40)}},
		},
		Janitor: &JanitorStep{Records: 2_000_000, Backlog: 500_000, BatchSize: 1000, Deleted: 500_000, SweepSeconds: 5, Claims: 10,
			Autovacuum: Autovacuum, AutovacuumTrigger: 30000, DeadAfterSweep: 500_000, VacuumSeconds: 2, FreePercent: 24.5, DeadPercent: 0,
			Before: Sizes{HeapMB: 660, TotalMB: 900, Indexes: ix(160, 40)}, AfterVacuum: Sizes{HeapMB: 660, TotalMB: 905, Indexes: ix(161, 41)},
			Refill: 500_000, AfterRefill: Sizes{HeapMB: 661, TotalMB: 930, Indexes: ix(170, 52)}},
		Note: "100M records not loaded: (--growth-budget)",
	}}
	var md bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{
		"| records | load s | load rows/s | heap MB | idem_records_pkey MB | idem_records_expires_at_idx MB | total MB | total MB per 1M records |",
		"| 2M | 40.0 | 50000 | 660 | 160 | 40 | 900 | 450 | 3 | 150 | 900 |",
		"Per million records at 2M: heap 330 MB, idem_records_pkey 80 MB, idem_records_expires_at_idx 20 MB, all indexes 100 MB, total 450 MB.",
		"deleted 500k in 5.0 s (100000 rows/s)",
		"the autovacuum starts at 30000 dead rows. Dead rows (n_dead_tup) after the sweep: 500000; VACUUM then took 2.0 s",
		"24.5% of the heap free",
		"| MB | before the sweep | after the sweep and VACUUM | after 500k fresh records |",
		"| heap | 660 | 660 | 661 |",
		"| idem_records_expires_at_idx | 40 | 41 | 52 |",
		"100M records not loaded",
	} {
		if !strings.Contains(md.String(), s) {
			t.Errorf("markdown lacks %q:\n%s", s, md.String())
		}
	}
}

// TestGrowthRowsOrder: a chunk is sent in key order, each record with an expiry
// of its own that grows in the order sent, as requests arriving one by one
// leave them (equal expiries would be deduplicated into a far smaller
// expires_at index than production's); the oldest records are expired.
func TestGrowthRowsOrder(t *testing.T) {
	t.Parallel()
	l := &growthLoader{expired: 10, start: time.Now()}
	rows := newGrowthRows(l, "g", 1, 1000)
	var lastKey []byte
	var lastLive time.Time
	seen, expired := map[time.Time]bool{}, 0
	for rows.Next() {
		v, err := rows.Values()
		if err != nil {
			t.Fatal(err)
		}
		key, exp := v[1].([]byte), v[7].(time.Time)
		if lastKey != nil && bytes.Compare(key, lastKey) <= 0 {
			t.Fatalf("key %s sent after %s", key, lastKey)
		}
		lastKey = append([]byte(nil), key...)
		if seen[exp] {
			t.Fatalf("two records expire at %v", exp)
		}
		seen[exp] = true
		if exp.Before(l.start) {
			expired++
			continue
		}
		if !exp.After(lastLive) {
			t.Fatalf("expiry %v sent after %v", exp, lastLive)
		}
		lastLive = exp
	}
	if len(seen) != 1000 || expired != 10 {
		t.Errorf("%d records, %d of them expired; want 1000, 10", len(seen), expired)
	}
}
