package storetest_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/storetest"
	"github.com/jackc/pgx/v5/pgxpool"
)

// PostgreSQL through a proxy that cuts a connection every few milliseconds,
// mid-statement and mid-transaction: calls fail with unknown outcomes, and the
// history must still be linearizable (a cut call took effect entirely or not at
// all). A cut every 30 ms, among connections at least 20 ms old, leaves a few
// per cent of the calls with unknown outcomes; a cut every 10 ms left 70–99 %
// on a machine where a call takes ~10 ms, and porcupine could then time out
// on a history that proves little.
func TestLinearizabilityPostgresConnectionsCut(t *testing.T) {
	t.Parallel()
	raw := testenv.PostgresURL(t)
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	target := u.Host
	if u.Port() == "" {
		target += ":5432"
	}
	proxy, err := faults.Listen(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	u.Host = proxy.Addr()
	cfg, err := pgxpool.ParseConfig(u.String())
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var b [6]byte
	_, _ = rand.Read(b[:])
	table := "idem_lin_" + hex.EncodeToString(b[:])
	s, err := pgstore.New(pool, &pgstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Through a fresh pool: the proxy may be closed by now.
		direct, err := pgxpool.New(context.Background(), raw)
		if err == nil {
			_, _ = direct.Exec(context.Background(), "DROP TABLE IF EXISTS "+table)
			direct.Close()
		}
	})
	opts := storetest.LinearizabilityOptions{
		RoundOps: 500, CallTimeout: 5 * time.Second,
		Fault: func() { proxy.CutOneOlderThan(20 * time.Millisecond) }, FaultInterval: 30 * time.Millisecond,
	}
	if os.Getenv(storetest.LinearizabilityEnv) == "" {
		opts.Ops = 1500 // otherwise as long as the environment asks
	} else if d, ok := t.Deadline(); ok {
		ctx, cancel = context.WithDeadline(context.Background(), d.Add(-30*time.Second))
		defer cancel()
	}
	res, err := storetest.CheckLinearizability(ctx, s, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d operations, %d with unknown outcomes (%v), %d cuts, %v", res.Ops, res.Unknown, res.UnknownErrors, proxy.Cuts(), res.Duration)
	if !res.Linearizable {
		t.Fatalf("%s\nvisualisation: %s", res.Problem, res.Visualization)
	}
	if res.Unknown == 0 {
		t.Errorf("no call failed in %d operations with %d cuts: the faults did not reach the store", res.Ops, proxy.Cuts())
	}
}
