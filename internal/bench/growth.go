package bench

import (
	"bytes"
	"context"
	"crypto/md5"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
)

// Autovacuum is the per-table autovacuum setting the growth run gives its records
// table: what docs/operating.md ("Running at scale") recommends for a pgstore
// table. The default scale factor (0.2) lets a 86 M-record table collect 17 M
// dead rows, hours of janitor deletes, before a vacuum makes their space
// reusable; at 0.01 a vacuum follows about every 860 k deletes, and the insert
// threshold keeps the visibility map and freezing up to date in small steps.
const Autovacuum = "autovacuum_vacuum_scale_factor = 0.01, autovacuum_vacuum_threshold = 10000, " +
	"autovacuum_vacuum_insert_scale_factor = 0.01, autovacuum_analyze_scale_factor = 0.01, autovacuum_vacuum_cost_limit = 1000"

// IndexSize is the size of one index of the records table.
type IndexSize struct {
	Name string  `json:"name"` // with the table's name written idem_records
	MB   float64 `json:"mb"`
}

// Sizes are the records table's sizes at one point of the run.
type Sizes struct {
	HeapMB  float64     `json:"heap_mb"`  // pg_relation_size: the main fork
	IndexMB float64     `json:"index_mb"` // pg_indexes_size: every index
	TotalMB float64     `json:"total_mb"` // pg_total_relation_size: heap, indexes, TOAST, FSM, VM
	Indexes []IndexSize `json:"indexes"`
}

// GrowthStep is the claim latency measured with Records records stored.
type GrowthStep struct {
	Records     int     `json:"records"`
	LoadSeconds float64 `json:"load_seconds"` // time to bulk-load up to Records
	LoadRate    float64 `json:"load_rows_per_s"`
	Claims      int     `json:"claims"`
	P50Micros   float64 `json:"claim_p50_us"`
	P99Micros   float64 `json:"claim_p99_us"`
	MeanMicros  float64 `json:"claim_mean_us"`
	TableMB     float64 `json:"table_mb"` // heap plus indexes (pg_total_relation_size)
	Sizes       Sizes   `json:"sizes"`
	// RefP50Micros and RefP99Micros are the claim latency on the reference table
	// (the smallest size, never grown), timed in the same window: claims alternate
	// between the two tables, so that the machine's drift hits both.
	RefP50Micros float64 `json:"ref_claim_p50_us"`
	RefP99Micros float64 `json:"ref_claim_p99_us"`
	// LoadAvg is /proc/loadavg's 1-minute figure when the step's claims were timed.
	LoadAvg float64 `json:"loadavg_1m"`
}

// MBPerMillion is the step's size per million records stored.
func (s GrowthStep) MBPerMillion(mb float64) float64 {
	if s.Records == 0 {
		return 0
	}
	return mb / (float64(s.Records) / 1e6)
}

// JanitorStep is the claim latency measured while Janitor.Sweep deletes an
// expired backlog, and the space the deletes leave.
type JanitorStep struct {
	// Records is how many records the table held, Backlog how many of them (the
	// oldest, first loaded) had expired.
	Records      int     `json:"records"`
	Backlog      int     `json:"backlog"`
	BatchSize    int     `json:"batch_size"`
	SweepSeconds float64 `json:"sweep_seconds"`
	Deleted      int     `json:"deleted"`
	Claims       int     `json:"claims"`
	P50Micros    float64 `json:"claim_p50_us"`
	P99Micros    float64 `json:"claim_p99_us"`
	MeanMicros   float64 `json:"claim_mean_us"`
	RefP50Micros float64 `json:"ref_claim_p50_us"`
	RefP99Micros float64 `json:"ref_claim_p99_us"`
	LoadAvg      float64 `json:"loadavg_1m"`

	// Autovacuum is the table's autovacuum setting, AutovacuumTrigger the dead
	// rows at which it starts a vacuum (threshold + scale factor × rows).
	Autovacuum        string `json:"autovacuum"`
	AutovacuumTrigger int    `json:"autovacuum_trigger"`
	// DeadAfterSweep is n_dead_tup (pg_stat_user_tables) after the sweep,
	// DeadAfterVacuum after the VACUUM that followed it.
	DeadAfterSweep  int64   `json:"dead_after_sweep"`
	DeadAfterVacuum int64   `json:"dead_after_vacuum"`
	VacuumSeconds   float64 `json:"vacuum_seconds"`
	// Autovacuums is how many autovacuums of the table finished during the run.
	Autovacuums int64 `json:"autovacuums"`
	Before      Sizes `json:"before"`       // before the sweep
	AfterVacuum Sizes `json:"after_vacuum"` // after the sweep and a VACUUM
	// FreePercent and DeadPercent are pgstattuple_approx's approx_free_percent
	// and dead_tuple_percent of the heap after the VACUUM; -1 when the
	// pgstattuple extension is not available.
	FreePercent float64 `json:"free_percent"`
	DeadPercent float64 `json:"dead_percent"`
	// Refill records were then loaded, fresh; AfterRefill is the size after.
	Refill      int   `json:"refill"`
	AfterRefill Sizes `json:"after_refill"`
}

// GrowthReport is the result of the PostgreSQL growth run: store.Claim on fresh
// keys, one at a time, with more and more complete records stored, and then
// while the janitor deletes a large expired backlog.
type GrowthReport struct {
	Version string `json:"version"`
	// RefRecords is the size of the reference table.
	RefRecords int `json:"ref_records"`
	// Loader says how the records were loaded.
	Loader  string       `json:"loader"`
	Steps   []GrowthStep `json:"steps"`
	Janitor *JanitorStep `json:"janitor,omitempty"`
	Note    string       `json:"note,omitempty"`
}

// growthColumns are the columns the loader fills, in order.
var growthColumns = []string{"scope", "key", "state", "fingerprint", "token", "created_at", "lease_until", "expires_at", "status", "headers", "body", "body_omitted"}

// growthLoader bulk-loads complete records shaped like the ones the benchmark's
// orders handler leaves: UUID keys spread over the whole key space (so every
// insert lands on a random leaf of the primary key, as in production), a v1
// fingerprint, a lock token, a JSON body of about 40 bytes, two stored headers.
// Record i of a table is the same whenever it is loaded. Records i ≤ expired
// expired during the hour before the load began, oldest first (the backlog of a
// table whose janitor has not run for an hour); the others expire DefaultTTL
// after they were loaded.
type growthLoader struct {
	pool    *pgxpool.Pool
	conns   int // connections loading in parallel
	chunk   int // records per COPY (one transaction)
	expired int
	start   time.Time
}

// load loads records from..to (inclusive) into table under the key prefix.
func (l *growthLoader) load(ctx context.Context, table, prefix string, from, to int) (time.Duration, error) {
	t0 := time.Now()
	if to < from {
		return 0, nil
	}
	var next atomic.Int64
	next.Store(int64(from))
	errs := make([]error, l.conns)
	var wg sync.WaitGroup
	for w := range l.conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = l.worker(ctx, table, prefix, &next, to)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return 0, err
	}
	if _, err := l.pool.Exec(ctx, "ANALYZE "+table); err != nil {
		return 0, err
	}
	return time.Since(t0), nil
}

func (l *growthLoader) worker(ctx context.Context, table, prefix string, next *atomic.Int64, to int) error {
	conn, err := l.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	// The settings are the loader's session's only, and put back before the
	// connection returns to the pool: the claims timed are sent with the
	// server's defaults.
	defer func() {
		_, err := conn.Exec(context.Background(), "RESET synchronous_commit; RESET wal_compression")
		if err != nil {
			conn.Conn().PgConn().Close(context.Background())
		}
		conn.Release()
	}()
	// synchronous_commit=off makes each COPY's commit not wait for its WAL
	// flush: a crash could lose the last chunks, never corrupt the table, which
	// stays logged and crash-safe. wal_compression needs superuser; without it
	// the load is only slower.
	if _, err := conn.Exec(ctx, "SET synchronous_commit = off"); err != nil {
		return err
	}
	_, _ = conn.Exec(ctx, "SET wal_compression = on")
	ident := pgx.Identifier(strings.Split(table, "."))
	for {
		lo := int(next.Add(int64(l.chunk))) - l.chunk
		if lo > to {
			return nil
		}
		hi := min(lo+l.chunk-1, to)
		rows := newGrowthRows(l, prefix, lo, hi)
		n, err := conn.CopyFrom(ctx, ident, growthColumns, rows)
		if err != nil {
			return fmt.Errorf("bulk load rows %d–%d: %w", lo, hi, err)
		}
		if int(n) != hi-lo+1 {
			return fmt.Errorf("bulk load rows %d–%d: COPY wrote %d rows", lo, hi, n)
		}
	}
}

// growthHeaders are the stored headers of every loaded record.
var growthHeaders = []byte(`{"Content-Type":["application/json"],"Location":["/orders/1"]}`)

// growthRows is a pgx.CopyFromSource of records lo..hi, sent in the order of
// their keys: each chunk then walks the primary key's leaves once, left to
// right, instead of landing on a random leaf per record, which on a table
// larger than shared_buffers costs a buffer miss (and after a checkpoint a
// full-page write) per record. The leaves still split where the keys fall, as
// with random inserts, so the index is as full as production's.
type growthRows struct {
	l      *growthLoader
	prefix string
	recs   []growthRec
	at     int
	now    time.Time
	vals   [12]any
}

type growthRec struct {
	h [md5.Size]byte
	i int
}

func newGrowthRows(l *growthLoader, prefix string, lo, hi int) *growthRows {
	r := &growthRows{l: l, prefix: prefix, recs: make([]growthRec, 0, hi-lo+1), at: -1, now: time.Now()}
	for i := lo; i <= hi; i++ {
		r.recs = append(r.recs, growthRec{h: md5.Sum([]byte(prefix + strconv.Itoa(i))), i: i})
	}
	slices.SortFunc(r.recs, func(a, b growthRec) int { return bytes.Compare(a.h[:], b.h[:]) })
	return r
}

func (r *growthRows) Next() bool { r.at++; return r.at < len(r.recs) }
func (r *growthRows) Err() error { return nil }

func (r *growthRows) Values() ([]any, error) {
	i, h := r.recs[r.at].i, r.recs[r.at].h
	f := sha256.Sum256(h[:])
	x := hex.EncodeToString(h[:])
	key := x[0:8] + "-" + x[8:12] + "-" + x[12:16] + "-" + x[16:20] + "-" + x[20:32]
	// A microsecond apart, in the order sent, as requests arriving one by one:
	// equal expiries would be deduplicated into a much smaller expires_at
	// index than production's.
	created := r.now.Add(time.Duration(r.at) * time.Microsecond)
	expires := created.Add(idem.DefaultTTL)
	if i <= r.l.expired {
		// Spread over the hour before the load began, oldest first.
		expires = r.l.start.Add(-time.Hour + time.Duration(int64(time.Hour)*int64(i)/int64(r.l.expired+1)))
		created = expires.Add(-idem.DefaultTTL)
	}
	r.vals = [12]any{
		[]byte{}, []byte(key), int16(2), []byte("v1:" + hex.EncodeToString(f[:])), hex.EncodeToString(f[:16]),
		created, created, expires, int32(201), growthHeaders,
		[]byte(`{"id":` + strconv.Itoa(i) + `,"item":"widget","qty":1}`), false,
	}
	return r.vals[:], nil
}

// sizes reads table's sizes.
func sizes(ctx context.Context, pool *pgxpool.Pool, table string) (Sizes, error) {
	var s Sizes
	var heap, idx, total int64
	err := pool.QueryRow(ctx, "SELECT pg_relation_size($1::regclass), pg_indexes_size($1::regclass), pg_total_relation_size($1::regclass)", table).Scan(&heap, &idx, &total)
	if err != nil {
		return s, fmt.Errorf("table size of %s: %w", table, err)
	}
	s.HeapMB, s.IndexMB, s.TotalMB = mb(heap), mb(idx), mb(total)
	rows, err := pool.Query(ctx, "SELECT c.relname, pg_relation_size(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE i.indrelid = $1::regclass ORDER BY i.indisprimary DESC, c.relname", table)
	if err != nil {
		return s, fmt.Errorf("index sizes of %s: %w", table, err)
	}
	defer rows.Close()
	base := table[strings.LastIndex(table, ".")+1:]
	for rows.Next() {
		var name string
		var n int64
		if err := rows.Scan(&name, &n); err != nil {
			return s, err
		}
		s.Indexes = append(s.Indexes, IndexSize{Name: strings.Replace(name, base, "idem_records", 1), MB: mb(n)})
	}
	return s, rows.Err()
}

// statsWait is how long deadTuples waits: sessions flush their statistics at
// most every second while busy, and within PGSTAT_IDLE_INTERVAL (10 s) once
// idle. Tests shorten it.
var statsWait = 11 * time.Second

func mb(n int64) float64 { return float64(n) / (1 << 20) }

// deadTuples reads n_dead_tup and the count of finished autovacuums of table,
// after waiting for the statistics of the other sessions to be flushed.
func deadTuples(ctx context.Context, pool *pgxpool.Pool, table string) (dead, autovacuums int64, err error) {
	select {
	case <-ctx.Done():
		return 0, 0, ctx.Err()
	case <-time.After(statsWait):
	}
	err = pool.QueryRow(ctx, "SELECT n_dead_tup, autovacuum_count FROM pg_stat_user_tables WHERE relid = $1::regclass", table).Scan(&dead, &autovacuums)
	if err != nil {
		err = fmt.Errorf("pg_stat_user_tables for %s: %w", table, err)
	}
	return dead, autovacuums, err
}

// runGrowth runs the growth benchmark in a dedicated table, dropped at the end.
func runGrowth(ctx context.Context, cfg *Config, suffix string) (*GrowthReport, error) {
	runStart := time.Now()
	pc, err := pgxpool.ParseConfig(cfg.PostgresURL)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	pc.MaxConns = int32(cfg.GrowthConns + 3)
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, unavailable("postgres: %v", err)
	}
	defer pool.Close()
	g := &GrowthReport{}
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	err = pool.QueryRow(pctx, "SHOW server_version").Scan(&g.Version)
	cancel()
	if err != nil {
		return nil, unavailable("postgres at %s: %v", pc.ConnConfig.Host, err)
	}
	g.Version = "PostgreSQL " + g.Version
	table, refTable := "idem_growth_"+suffix, "idem_growth_ref_"+suffix
	store, err := pgstore.New(pool, &pgstore.Config{Table: table})
	if err != nil {
		return g, err
	}
	ref, err := pgstore.New(pool, &pgstore.Config{Table: refTable})
	if err != nil {
		return g, err
	}
	var dropExtension bool
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		// Migrate creates each store's step table too.
		_, _ = pool.Exec(c, "DROP TABLE IF EXISTS "+table+", "+refTable+", "+store.StepsTable()+", "+ref.StepsTable())
		if dropExtension {
			_, _ = pool.Exec(c, "DROP EXTENSION IF EXISTS pgstattuple")
		}
	}()
	if err := store.Migrate(ctx); err != nil {
		return g, err
	}
	if err := ref.Migrate(ctx); err != nil {
		return g, err
	}
	for _, t := range []string{table, refTable} {
		if _, err := pool.Exec(ctx, "ALTER TABLE "+t+" SET ("+Autovacuum+")"); err != nil {
			return g, fmt.Errorf("autovacuum settings of %s: %w", t, err)
		}
	}
	largest := 0
	for _, s := range cfg.GrowthSizes {
		largest = max(largest, s)
	}
	backlog := min(cfg.JanitorBacklog, largest)
	l := &growthLoader{pool: pool, conns: cfg.GrowthConns, chunk: cfg.GrowthChunk, expired: max(backlog, 0), start: runStart}
	var autovacuum string
	if err := pool.QueryRow(ctx, "SHOW autovacuum").Scan(&autovacuum); err != nil {
		return g, err
	}
	g.Loader = fmt.Sprintf("COPY of %d-record chunks (one transaction each) on %d connections, synchronous_commit=off and wal_compression=on for the loading sessions only; logged table; the server's autovacuum is %s; table settings: %s", l.chunk, l.conns, autovacuum, Autovacuum)
	if autovacuum != "on" {
		g.Loader += " (they take effect only with the server's autovacuum on: the VACUUM after the sweep stands in for it)"
	}
	g.RefRecords = cfg.GrowthSizes[0]
	ref0 := &growthLoader{pool: pool, conns: 1, chunk: l.chunk, start: runStart}
	if _, err := ref0.load(ctx, refTable, "r", 1, g.RefRecords); err != nil {
		return g, err
	}
	var skipped []string
	loaded, loadTime := 0, time.Duration(0)
	for _, size := range cfg.GrowthSizes {
		if size < loaded {
			continue
		}
		if cfg.GrowthBudget > 0 && loaded > 0 && loadTime > 0 {
			// The load slows down as the table grows: project at 2/3 of
			// the last step's rate.
			rate := g.Steps[len(g.Steps)-1].LoadRate * 2 / 3
			need := time.Duration(float64(size-loaded) / rate * float64(time.Second))
			if left := cfg.GrowthBudget - time.Since(runStart); need > left {
				skipped = append(skipped, fmt.Sprintf("%s records not loaded: at %.0f records/s (2/3 of the last step's rate) the load would take %s, %s left of the %s budget (--growth-budget)",
					count(size), rate, need.Round(time.Second), left.Round(time.Second), cfg.GrowthBudget))
				fmt.Fprintf(cfg.Log, "growth   %s\n", skipped[len(skipped)-1])
				break
			}
		}
		took, err := l.load(ctx, table, "g", loaded+1, size)
		if err != nil {
			return g, err
		}
		rate := float64(size-loaded) / took.Seconds()
		loaded, loadTime = size, loadTime+took
		ls, rls, err := timeClaims(ctx, store, ref, cfg.GrowthClaims, nil)
		if err != nil {
			return g, err
		}
		p50, p99, mean := latencyStats(ls)
		rp50, rp99, _ := latencyStats(rls)
		step := GrowthStep{Records: size, LoadSeconds: took.Seconds(), LoadRate: rate, Claims: len(ls), P50Micros: micros(p50), P99Micros: micros(p99), MeanMicros: micros(mean),
			RefP50Micros: micros(rp50), RefP99Micros: micros(rp99), LoadAvg: loadAvg1()}
		if step.Sizes, err = sizes(ctx, pool, table); err != nil {
			return g, err
		}
		step.TableMB = step.Sizes.TotalMB
		g.Steps = append(g.Steps, step)
		fmt.Fprintf(cfg.Log, "growth   %10d records  loaded in %6.1fs (%.0f/s)  claim p50 %6.0fµs p99 %6.0fµs  (%.0f MB: heap %.0f, indexes %.0f; reference table meanwhile p50 %.0fµs p99 %.0fµs; load %.2f)\n",
			size, took.Seconds(), rate, step.P50Micros, step.P99Micros, step.TableMB, step.Sizes.HeapMB, step.Sizes.IndexMB, step.RefP50Micros, step.RefP99Micros, step.LoadAvg)
	}
	g.Note = strings.Join(skipped, "; ")
	if cfg.JanitorBacklog < 0 || loaded == 0 {
		return g, nil
	}
	backlog = min(backlog, loaded)
	js, err := janitorStep(ctx, cfg, pool, l, store, ref, table, loaded, backlog, &dropExtension)
	g.Janitor = js
	return g, err
}

// janitorStep times claims while Janitor.Sweep deletes the backlog (the oldest
// records, expired), then vacuums and measures what the deletes left.
func janitorStep(ctx context.Context, cfg *Config, pool *pgxpool.Pool, l *growthLoader, store, ref idem.Store, table string, records, backlog int, dropExtension *bool) (*JanitorStep, error) {
	js := &JanitorStep{Records: records, Backlog: backlog, BatchSize: 1000, Autovacuum: Autovacuum, FreePercent: -1, DeadPercent: -1}
	var err error
	if js.Before, err = sizes(ctx, pool, table); err != nil {
		return js, err
	}
	var reltuples float64
	var threshold int
	var scale float64
	err = pool.QueryRow(ctx, `SELECT c.reltuples,
	  coalesce((SELECT split_part(o, '=', 2)::int FROM unnest(c.reloptions) o WHERE o LIKE 'autovacuum_vacuum_threshold=%'), current_setting('autovacuum_vacuum_threshold')::int),
	  coalesce((SELECT split_part(o, '=', 2)::float8 FROM unnest(c.reloptions) o WHERE o LIKE 'autovacuum_vacuum_scale_factor=%'), current_setting('autovacuum_vacuum_scale_factor')::float8)
	  FROM pg_class c WHERE c.oid = $1::regclass`, table).Scan(&reltuples, &threshold, &scale)
	if err != nil {
		return js, fmt.Errorf("autovacuum settings of %s: %w", table, err)
	}
	js.AutovacuumTrigger = threshold + int(scale*reltuples)
	_, av0, err := deadTuples(ctx, pool, table)
	if err != nil {
		return js, err
	}
	j := &idem.Janitor{Store: store, BatchSize: js.BatchSize}
	done := make(chan struct{})
	var sweepErr error
	var wg sync.WaitGroup
	wg.Add(1)
	sweepStart := time.Now()
	go func() {
		defer wg.Done()
		defer close(done)
		js.Deleted, sweepErr = j.Sweep(ctx)
		js.SweepSeconds = time.Since(sweepStart).Seconds()
	}()
	ls, rls, err := timeClaims(ctx, store, ref, 0, done)
	wg.Wait()
	js.LoadAvg = loadAvg1()
	if err != nil {
		return js, err
	}
	if sweepErr != nil {
		return js, sweepErr
	}
	js.Claims = len(ls)
	p50, p99, mean := latencyStats(ls)
	js.P50Micros, js.P99Micros, js.MeanMicros = micros(p50), micros(p99), micros(mean)
	rp50, rp99, _ := latencyStats(rls)
	js.RefP50Micros, js.RefP99Micros = micros(rp50), micros(rp99)
	fmt.Fprintf(cfg.Log, "janitor  %10d expired deleted in %5.1fs (%.0f/s)  claim p50 %6.0fµs p99 %6.0fµs meanwhile (%d claims; reference table p50 %.0fµs p99 %.0fµs)\n",
		js.Deleted, js.SweepSeconds, float64(js.Deleted)/js.SweepSeconds, js.P50Micros, js.P99Micros, js.Claims, js.RefP50Micros, js.RefP99Micros)
	if js.Deleted < js.Backlog {
		return js, fmt.Errorf("the janitor deleted %d of %d expired records", js.Deleted, js.Backlog)
	}
	if js.DeadAfterSweep, _, err = deadTuples(ctx, pool, table); err != nil {
		return js, err
	}
	// What the autovacuum does at these settings once the dead rows pass
	// AutovacuumTrigger, done now and without its cost delay, so that the run
	// does not wait for the autovacuum launcher's next round.
	t0 := time.Now()
	if _, err := pool.Exec(ctx, "VACUUM "+table); err != nil {
		return js, fmt.Errorf("vacuum %s: %w", table, err)
	}
	js.VacuumSeconds = time.Since(t0).Seconds()
	var av1 int64
	if js.DeadAfterVacuum, av1, err = deadTuples(ctx, pool, table); err != nil {
		return js, err
	}
	js.Autovacuums = av1 - av0
	if js.AfterVacuum, err = sizes(ctx, pool, table); err != nil {
		return js, err
	}
	if ok, created := pgstattuple(ctx, pool); ok {
		*dropExtension = created
		if err := pool.QueryRow(ctx, "SELECT approx_free_percent, dead_tuple_percent FROM pgstattuple_approx($1::regclass)", table).Scan(&js.FreePercent, &js.DeadPercent); err != nil {
			return js, fmt.Errorf("pgstattuple_approx(%s): %w", table, err)
		}
	}
	fmt.Fprintf(cfg.Log, "janitor  vacuum %.1fs; dead rows %d after the sweep, %d after the vacuum; heap %.0f MB → %.0f MB, free %.1f%%, dead %.1f%%\n",
		js.VacuumSeconds, js.DeadAfterSweep, js.DeadAfterVacuum, js.Before.HeapMB, js.AfterVacuum.HeapMB, js.FreePercent, js.DeadPercent)
	// New records reuse the space the deleted ones left.
	js.Refill = min(js.Deleted, 1_000_000)
	if _, err := l.load(ctx, table, "n", 1, js.Refill); err != nil {
		return js, err
	}
	if js.AfterRefill, err = sizes(ctx, pool, table); err != nil {
		return js, err
	}
	fmt.Fprintf(cfg.Log, "janitor  %d fresh records loaded after the vacuum: heap %.0f MB → %.0f MB, indexes %.0f MB → %.0f MB\n",
		js.Refill, js.AfterVacuum.HeapMB, js.AfterRefill.HeapMB, js.AfterVacuum.IndexMB, js.AfterRefill.IndexMB)
	return js, nil
}

// pgstattuple reports whether the pgstattuple extension is installed, creating
// it when it is available; created says the run created it (and drops it).
func pgstattuple(ctx context.Context, pool *pgxpool.Pool) (ok, created bool) {
	var installed, available bool
	err := pool.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'pgstattuple'), EXISTS (SELECT 1 FROM pg_available_extensions WHERE name = 'pgstattuple')").Scan(&installed, &available)
	if err != nil || installed || !available {
		return err == nil && installed, false
	}
	if _, err := pool.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pgstattuple"); err != nil {
		return false, false
	}
	return true, true
}

// timeClaims times store.Claim on fresh random keys, one at a time, alternating
// with a claim on ref: n claims on each, or, when until is not nil, claims until
// it is closed.
func timeClaims(ctx context.Context, store, ref idem.Store, n int, until <-chan struct{}) (ls, refLs []time.Duration, err error) {
	for i := 0; until != nil || i < n; i++ {
		if until != nil {
			select {
			case <-until:
				return ls, refLs, nil
			default:
			}
		}
		if err := ctx.Err(); err != nil {
			return ls, refLs, err
		}
		d, err := timeClaim(ctx, store)
		if err != nil {
			return ls, refLs, err
		}
		ls = append(ls, d)
		if d, err = timeClaim(ctx, ref); err != nil {
			return ls, refLs, err
		}
		refLs = append(refLs, d)
	}
	return ls, refLs, nil
}

// timeClaim claims a fresh random key and returns how long it took.
func timeClaim(ctx context.Context, store idem.Store) (time.Duration, error) {
	now := time.Now()
	req := idem.ClaimRequest{
		Key: uuidKey(), Fingerprint: "v1:" + randomHex(32), Token: randomHex(16),
		Now: now, LeaseUntil: now.Add(idem.DefaultLease), ExpiresAt: now.Add(idem.DefaultTTL),
	}
	t0 := time.Now()
	_, claimed, err := store.Claim(ctx, req)
	d := time.Since(t0)
	if err != nil {
		return d, fmt.Errorf("claim: %w", err)
	}
	if !claimed {
		return d, fmt.Errorf("claim of fresh key %s was refused", req.Key)
	}
	return d, nil
}

func uuidKey() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	b[6] = b[6]&0x0f | 0x40
	b[8] = b[8]&0x3f | 0x80
	h := hex.EncodeToString(b[:])
	return h[0:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:32]
}
