package bench

import (
	"context"
	"database/sql"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/testenv"
)

// delta runs f and returns how many round trips and statements w counted.
func delta(t *testing.T, w *wireCounter, f func() error) (rt, st int64) {
	t.Helper()
	r0, s0 := w.roundTrips.Load(), w.statements.Load()
	if err := f(); err != nil {
		t.Fatal(err)
	}
	return w.roundTrips.Load() - r0, w.statements.Load() - s0
}

func TestWireCounterPostgres(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pc, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	w := &wireCounter{proto: protoPostgres}
	pc.ConnConfig.DialFunc = w.dial
	pc.MaxConns = 1
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var n int
	if err := pool.QueryRow(ctx, "SELECT 1").Scan(&n); err != nil { // connect, prepare
		t.Fatal(err)
	}
	// A cached statement: one Bind/Execute/Sync, one round trip.
	if rt, st := delta(t, w, func() error { return pool.QueryRow(ctx, "SELECT 1").Scan(&n) }); rt != 1 || st != 1 {
		t.Errorf("one query: %d round trips, %d statements; want 1, 1", rt, st)
	}
	// A batch of three, its statements prepared by a first run: one round trip.
	batch := func() error {
		b := &pgx.Batch{}
		b.Queue("SELECT 1")
		b.Queue("SELECT 2")
		b.Queue("SELECT $1::int", 3)
		return pool.SendBatch(ctx, b).Close()
	}
	if err := batch(); err != nil {
		t.Fatal(err)
	}
	rt, st := delta(t, w, batch)
	if rt != 1 || st != 3 {
		t.Errorf("batch of 3: %d round trips, %d statements; want 1, 3", rt, st)
	}
	// Two queries in sequence: two round trips. A large parameter crosses writes.
	big := make([]byte, 200_000)
	rt, st = delta(t, w, func() error {
		if _, err := pool.Exec(ctx, "SELECT length($1::bytea)", big); err != nil {
			return err
		}
		return pool.QueryRow(ctx, "SELECT 1").Scan(&n)
	})
	if rt < 2 || st != 2 {
		t.Errorf("two queries, one with 200 kB: %d round trips, %d statements; want ≥ 2, 2", rt, st)
	}
}

func TestWireCounterMySQL(t *testing.T) {
	t.Parallel()
	mc, err := mysql.ParseDSN(testenv.MySQLDSN(testenv.MySQLURL(t)))
	if err != nil {
		t.Fatal(err)
	}
	w := &wireCounter{proto: protoMySQL}
	mc.DialFunc = w.dial
	conn, err := mysql.NewConnector(mc)
	if err != nil {
		t.Fatal(err)
	}
	db := sql.OpenDB(conn)
	defer db.Close()
	db.SetMaxOpenConns(1)
	if err := db.Ping(); err != nil {
		t.Fatal(err)
	}
	if rt, st := delta(t, w, func() error { _, err := db.Exec("DO 1"); return err }); rt != 1 || st != 1 {
		t.Errorf("one COM_QUERY: %d round trips, %d statements; want 1, 1", rt, st)
	}
	// A prepared statement with an argument: prepare, execute, close.
	rt, st := delta(t, w, func() error { var n int; return db.QueryRow("SELECT ?", 7).Scan(&n) })
	if st != 1 || rt < 2 {
		t.Errorf("prepared SELECT ?: %d round trips, %d statements; want ≥ 2 (prepare, execute), 1", rt, st)
	}
}

func TestWireCounterRedis(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	opt, err := redis.ParseURL(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	w := &wireCounter{proto: protoRedis}
	opt.Dialer = w.dial
	opt.PoolSize = 1
	rdb := redis.NewClient(opt)
	defer rdb.Close()
	key := "idembench_test_wire_" + randomHex(4)
	defer rdb.Del(ctx, key)
	set := func() error { return rdb.Set(ctx, key, "a\r\n*3\r\n$1", 0).Err() }
	if err := set(); err != nil {
		t.Fatal(err)
	}
	if rt, st := delta(t, w, set); rt != 1 || st != 1 {
		t.Errorf("one SET (a value that looks like RESP): %d round trips, %d statements; want 1, 1", rt, st)
	}
	pipeline := func() error {
		_, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Get(ctx, key)
			p.Incr(ctx, key+":n")
			p.Del(ctx, key+":n")
			return nil
		})
		return err
	}
	if err := pipeline(); err != nil { // go-redis may dial again after HELLO
		t.Fatal(err)
	}
	rt, st := delta(t, w, pipeline)
	if rt != 1 || st != 3 {
		t.Errorf("pipeline of 3: %d round trips, %d statements; want 1, 3", rt, st)
	}
}
