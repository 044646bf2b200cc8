package bench

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
)

// GrowthStep is the claim latency measured with Records records stored.
type GrowthStep struct {
	Records     int     `json:"records"`
	LoadSeconds float64 `json:"load_seconds"` // time to bulk-load up to Records
	Claims      int     `json:"claims"`
	P50Micros   float64 `json:"claim_p50_us"`
	P99Micros   float64 `json:"claim_p99_us"`
	MeanMicros  float64 `json:"claim_mean_us"`
	TableMB     float64 `json:"table_mb"` // heap plus indexes
	// RefP50Micros and RefP99Micros are the claim latency on the reference table
	// (the smallest size, never grown), timed in the same window: claims alternate
	// between the two tables, so that the machine's drift hits both.
	RefP50Micros float64 `json:"ref_claim_p50_us"`
	RefP99Micros float64 `json:"ref_claim_p99_us"`
}

// JanitorStep is the claim latency measured while Janitor.Sweep deletes an
// expired backlog.
type JanitorStep struct {
	Backlog      int     `json:"backlog"`
	BatchSize    int     `json:"batch_size"`
	LoadSeconds  float64 `json:"load_seconds"`
	SweepSeconds float64 `json:"sweep_seconds"`
	Deleted      int     `json:"deleted"`
	Claims       int     `json:"claims"`
	P50Micros    float64 `json:"claim_p50_us"`
	P99Micros    float64 `json:"claim_p99_us"`
	MeanMicros   float64 `json:"claim_mean_us"`
	RefP50Micros float64 `json:"ref_claim_p50_us"`
	RefP99Micros float64 `json:"ref_claim_p99_us"`
}

// GrowthReport is the result of the PostgreSQL growth run: store.Claim on fresh
// keys, one at a time, with more and more complete records stored, and then
// while the janitor deletes a large expired backlog.
type GrowthReport struct {
	Version string `json:"version"`
	// RefRecords is the size of the reference table.
	RefRecords int          `json:"ref_records"`
	Steps      []GrowthStep `json:"steps"`
	Janitor    *JanitorStep `json:"janitor,omitempty"`
	Note       string       `json:"note,omitempty"`
}

// The bulk load writes complete records shaped like the ones the benchmark's
// orders handler leaves: UUID keys spread over the whole key space, a v1
// fingerprint, a JSON body of about 40 bytes, two stored headers.
const growthInsert = `INSERT INTO %s (scope, key, state, fingerprint, token, created_at, lease_until, expires_at, status, headers, body, body_omitted)
SELECT ''::bytea, convert_to(md5(%s || i)::uuid::text, 'UTF8'), 2,
       convert_to('v1:' || md5('f' || i) || md5('h' || i), 'UTF8'), md5('t' || i),
       now(), now(), now() + %s,
       201, '{"Content-Type":["application/json"],"Location":["/orders/1"]}'::jsonb,
       convert_to('{"id":' || i || ',"item":"widget","qty":1}', 'UTF8'), false
FROM generate_series($1::bigint, $2::bigint) AS i`

// runGrowth runs the growth benchmark in a dedicated table, dropped at the end.
func runGrowth(ctx context.Context, cfg *Config, suffix string) (*GrowthReport, error) {
	pc, err := pgxpool.ParseConfig(cfg.PostgresURL)
	if err != nil {
		return nil, fmt.Errorf("postgres: %w", err)
	}
	pc.MaxConns = 4
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
	defer func() {
		c, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, _ = pool.Exec(c, "DROP TABLE IF EXISTS "+table+", "+refTable)
	}()
	store, err := pgstore.New(pool, &pgstore.Config{Table: table})
	if err != nil {
		return g, err
	}
	ref, err := pgstore.New(pool, &pgstore.Config{Table: refTable})
	if err != nil {
		return g, err
	}
	if err := store.Migrate(ctx); err != nil {
		return g, err
	}
	if err := ref.Migrate(ctx); err != nil {
		return g, err
	}
	load := func(table string, from, to int, prefix, expiry string) (time.Duration, error) {
		start := time.Now()
		const chunk = 500_000
		q := fmt.Sprintf(growthInsert, table, prefix, expiry)
		for lo := from; lo <= to; lo += chunk {
			hi := min(lo+chunk-1, to)
			if _, err := pool.Exec(ctx, q, lo, hi); err != nil {
				return 0, fmt.Errorf("bulk load rows %d–%d: %w", lo, hi, err)
			}
		}
		if _, err := pool.Exec(ctx, "ANALYZE "+table); err != nil {
			return 0, err
		}
		return time.Since(start), nil
	}
	g.RefRecords = cfg.GrowthSizes[0]
	if _, err := load(refTable, 1, g.RefRecords, "'g'", "interval '1 day'"); err != nil {
		return g, err
	}
	loaded := 0
	for _, size := range cfg.GrowthSizes {
		if size < loaded {
			continue
		}
		took, err := load(table, loaded+1, size, "'g'", "interval '1 day'")
		if err != nil {
			return g, err
		}
		loaded = size
		ls, rls, err := timeClaims(ctx, store, ref, cfg.GrowthClaims, nil)
		if err != nil {
			return g, err
		}
		p50, p99, mean := latencyStats(ls)
		rp50, rp99, _ := latencyStats(rls)
		step := GrowthStep{Records: size, LoadSeconds: took.Seconds(), Claims: len(ls), P50Micros: micros(p50), P99Micros: micros(p99), MeanMicros: micros(mean),
			RefP50Micros: micros(rp50), RefP99Micros: micros(rp99)}
		var bytes int64
		_ = pool.QueryRow(ctx, "SELECT pg_total_relation_size($1::regclass)", table).Scan(&bytes)
		step.TableMB = float64(bytes) / (1 << 20)
		g.Steps = append(g.Steps, step)
		fmt.Fprintf(cfg.Log, "growth   %10d records  loaded in %5.1fs  claim p50 %6.0fµs p99 %6.0fµs  (%.0f MB; reference table meanwhile p50 %.0fµs p99 %.0fµs)\n", size, took.Seconds(), step.P50Micros, step.P99Micros, step.TableMB, step.RefP50Micros, step.RefP99Micros)
	}
	if cfg.JanitorBacklog < 0 {
		return g, nil
	}
	js := &JanitorStep{Backlog: cfg.JanitorBacklog, BatchSize: 1000}
	took, err := load(table, 1, cfg.JanitorBacklog, "'x'", "interval '-1 hour'")
	if err != nil {
		return g, err
	}
	js.LoadSeconds = took.Seconds()
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
	if err != nil {
		return g, err
	}
	if sweepErr != nil {
		return g, sweepErr
	}
	js.Claims = len(ls)
	p50, p99, mean := latencyStats(ls)
	js.P50Micros, js.P99Micros, js.MeanMicros = micros(p50), micros(p99), micros(mean)
	rp50, rp99, _ := latencyStats(rls)
	js.RefP50Micros, js.RefP99Micros = micros(rp50), micros(rp99)
	g.Janitor = js
	fmt.Fprintf(cfg.Log, "janitor  %10d expired deleted in %5.1fs  claim p50 %6.0fµs p99 %6.0fµs meanwhile (%d claims; reference table p50 %.0fµs p99 %.0fµs)\n", js.Deleted, js.SweepSeconds, js.P50Micros, js.P99Micros, js.Claims, js.RefP50Micros, js.RefP99Micros)
	if js.Deleted < js.Backlog {
		return g, fmt.Errorf("the janitor deleted %d of %d expired records", js.Deleted, js.Backlog)
	}
	return g, nil
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
