package bench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime/pprof"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// Variant names, as they appear in the report.
const (
	VariantBaseline = "baseline"             // the handler without idempotency middleware
	VariantFirst    = "first"                // idempotency middleware, a fresh key per request
	VariantReplay   = "replay"               // keys that completed before the cell: every answer is a replay
	VariantHot      = "hot key"              // all clients send one key (a new one every HotKeyEvery requests)
	VariantSingleTx = "single-tx first"      // SQL stores, Flow = FlowSingleTx, fresh keys
	VariantClaim    = "claim-complete first" // PostgreSQL, Flow = FlowClaimComplete, fresh keys
	VariantHand     = "hand-written first"   // PostgreSQL and MariaDB, the hand-written reference, fresh keys
)

// HotKeyEvery is how many requests of the hot-key case share one key before the
// next key starts: each key is executed once and the rest are 409s (while it is
// in flight) and replays.
const HotKeyEvery = 100

// keyKind says which keys a variant sends.
type keyKind uint8

const (
	keysNone keyKind = iota
	keysFresh
	keysPool
	keysHot
)

type variant struct {
	name string
	path string
	keys keyKind
}

// target is one server under test: a store behind idem (or Fiber), its orders
// backend, and the variants run against it.
type target struct {
	name     string
	backend  backend
	version  string // server version, for the report
	store    string // what keeps the idempotency records
	url      string // http://127.0.0.1:port
	variants []variant
	// replayHeader is false for Fiber, which does not mark replays: they are
	// told apart from executions by counting rows.
	replayHeader bool
	close        func()
	// orders says where the orders go, for the report.
	orders string
	// pid is the server process of an isolated run (0: this process).
	pid int
	// wire counts round trips and statements to the database (nil: not counted).
	wire *wireCounter
	// dbCPU returns the CPU time the database has used so far, in ns (nil: not
	// measured); dbCPUWhat says whose CPU it is.
	dbCPU func(ctx context.Context) int64
	// hand is the hand-written reference (PostgreSQL, MariaDB), mounted on
	// /hand/orders.
	hand http.Handler
	// handOnly: the target runs no claim-complete variant beside hand (MariaDB).
	handOnly bool
}

// idemConfig is the middleware configuration of every idem target: the
// defaults (the store's default flow), except a TTL of one hour so that anything
// a crashed run leaves in Redis expires.
func idemConfig() *idem.Config {
	return &idem.Config{TTL: time.Hour}
}

// serveIdem starts an HTTP server on loopback with the bare handler on
// /bare/orders and idem with its default flow in front of it on /idem/orders;
// for the SQL stores (singleTx) idem in the single-transaction flow on
// /single/orders; for PostgreSQL also idem in the claim-then-complete flow on
// /claim/orders and the hand-written reference (t.hand) on /hand/orders.
func serveIdem(t *target, store idem.Store, singleTx bool) error {
	h := ordersHandler(t.backend)
	mux := http.NewServeMux()
	mux.Handle("POST /bare/orders", h)
	mux.Handle("GET "+statsPath, statsHandler(t))
	mw, err := idem.New(store, idemConfig())
	if err != nil {
		return err
	}
	mux.Handle("POST /idem/orders", mw(h))
	t.variants = []variant{
		{VariantBaseline, "/bare/orders", keysNone},
		{VariantFirst, "/idem/orders", keysFresh},
		{VariantReplay, "/idem/orders", keysPool},
		{VariantHot, "/idem/orders", keysHot},
	}
	if singleTx {
		cfg := idemConfig()
		cfg.Flow = idem.FlowSingleTx
		smw, err := idem.New(store, cfg)
		if err != nil {
			return err
		}
		mux.Handle("POST /single/orders", smw(h))
		t.variants = append(t.variants, variant{VariantSingleTx, "/single/orders", keysFresh})
	}
	if t.hand != nil && !t.handOnly {
		cfg := idemConfig()
		cfg.Flow = idem.FlowClaimComplete
		cmw, err := idem.New(store, cfg)
		if err != nil {
			return err
		}
		mux.Handle("POST /claim/orders", cmw(h))
		t.variants = append(t.variants, variant{VariantClaim, "/claim/orders", keysFresh})
	}
	if t.hand != nil {
		mux.Handle("POST /hand/orders", t.hand)
		t.variants = append(t.variants, variant{VariantHand, "/hand/orders", keysFresh})
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	var handler http.Handler = mux
	if os.Getenv(CPUProfileEnv) != "" {
		handler = profileLabels(mux, t.variants)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.url = "http://" + ln.Addr().String()
	t.replayHeader = true
	prev := t.close
	t.close = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = srv.Shutdown(ctx)
		if prev != nil {
			prev()
		}
	}
	return nil
}

// setupTarget prepares the store called name (memory, sqlite, postgres, mysql,
// redis) with fresh tables or prefixes named after suffix, and starts its server.
// A store that cannot be reached returns an errUnavailable.
func setupTarget(ctx context.Context, name string, cfg *Config, suffix string) (*target, error) {
	t := &target{name: name}
	var store idem.Store
	singleTx := false
	switch name {
	case "memory":
		ms := memstore.New(nil)
		t.close = func() { _ = ms.Close() }
		t.backend, t.store, t.version = newMemBackend(), "memstore (in-process)", "—"
		store = ms
	case "sqlite":
		dir, err := os.MkdirTemp("", "idem-bench-")
		if err != nil {
			return nil, err
		}
		db, err := embedded.Open(filepath.Join(dir, "bench.db"))
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, unavailable("sqlite: %v", err)
		}
		t.close = func() { _ = db.Close(); _ = os.RemoveAll(dir) }
		orders := "orders_bench_" + suffix
		if _, err := db.ExecContext(ctx, "CREATE TABLE "+orders+" (id INTEGER PRIMARY KEY, item TEXT NOT NULL, qty INTEGER NOT NULL, created_at INTEGER NOT NULL DEFAULT (strftime('%s','now')))"); err != nil {
			t.close()
			return nil, err
		}
		st, err := sqlitestore.New(db, &sqlitestore.Config{Table: "idem_bench_" + suffix})
		if err == nil {
			err = st.Migrate(ctx)
		}
		if err != nil {
			t.close()
			return nil, err
		}
		_ = db.QueryRowContext(ctx, "SELECT sqlite_version()").Scan(&t.version)
		t.version = "SQLite " + t.version + " (modernc.org/sqlite, WAL)"
		t.backend, t.store = &sqliteBackend{db: db, table: orders}, "sqlitestore, temporary file"
		store, singleTx = st, true
	case "postgres":
		pc, err := pgxpool.ParseConfig(cfg.PostgresURL)
		if err != nil {
			return nil, fmt.Errorf("postgres: %w", err)
		}
		pc.MaxConns = int32(cfg.PoolSize)
		appName := "idem-bench-" + suffix
		pc.ConnConfig.RuntimeParams["application_name"] = appName
		t.wire = &wireCounter{proto: protoPostgres}
		pc.ConnConfig.DialFunc = t.wire.dial
		pool, err := pgxpool.NewWithConfig(ctx, pc)
		if err != nil {
			return nil, unavailable("postgres: %v", err)
		}
		// admin does the harness's bookkeeping (row counts, backend PIDs), on
		// connections that are neither counted nor part of the measured backends.
		ac, _ := pgxpool.ParseConfig(cfg.PostgresURL)
		ac.MaxConns = 2
		admin, err := pgxpool.NewWithConfig(ctx, ac)
		if err != nil {
			pool.Close()
			return nil, unavailable("postgres: %v", err)
		}
		pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		err = pool.QueryRow(pctx, "SHOW server_version").Scan(&t.version)
		cancel()
		if err != nil {
			pool.Close()
			admin.Close()
			return nil, unavailable("postgres at %s: %v", pc.ConnConfig.Host, err)
		}
		t.version = "PostgreSQL " + t.version
		records, orders, handKeys := "idem_bench_"+suffix, "orders_bench_"+suffix, "hand_keys_"+suffix
		t.close = func() {
			c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			pool.Close()
			_, _ = admin.Exec(c, "DROP TABLE IF EXISTS "+records+", "+orders+", "+handKeys)
			admin.Close()
		}
		t.dbCPU = pgBackendsCPU(admin, appName)
		if _, err := pool.Exec(ctx, "CREATE TABLE "+orders+" (id bigserial PRIMARY KEY, item text NOT NULL, qty integer NOT NULL, created_at timestamptz NOT NULL DEFAULT now())"); err != nil {
			t.close()
			return nil, err
		}
		st, err := pgstore.New(pool, &pgstore.Config{Table: records})
		if err == nil {
			err = st.Migrate(ctx)
		}
		if err != nil {
			t.close()
			return nil, err
		}
		hand, err := newHandOrders(ctx, pool, orders, handKeys)
		if err != nil {
			t.close()
			return nil, err
		}
		t.hand = hand
		t.backend, t.store = &pgBackend{pool: pool, admin: admin, table: orders}, "pgstore, same database"
		store, singleTx = st, true
	case "mysql":
		mc, err := mysql.ParseDSN(cfg.MySQLDSN)
		if err != nil {
			return nil, fmt.Errorf("mysql: %w", err)
		}
		admin, err := sql.Open("mysql", cfg.MySQLDSN)
		if err != nil {
			return nil, fmt.Errorf("mysql: %w", err)
		}
		t.wire = &wireCounter{proto: protoMySQL}
		mc.DialFunc = t.wire.dial
		conn, err := mysql.NewConnector(mc)
		if err != nil {
			_ = admin.Close()
			return nil, fmt.Errorf("mysql: %w", err)
		}
		db := sql.OpenDB(conn)
		db.SetMaxOpenConns(cfg.PoolSize)
		db.SetMaxIdleConns(cfg.PoolSize)
		pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		err = db.QueryRowContext(pctx, "SELECT VERSION()").Scan(&t.version)
		cancel()
		if err != nil {
			_ = db.Close()
			_ = admin.Close()
			return nil, unavailable("mysql: %v", err)
		}
		t.version = "MySQL/MariaDB " + t.version
		records, orders, handKeys := "idem_bench_"+suffix, "orders_bench_"+suffix, "hand_keys_"+suffix
		t.close = func() {
			c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			_ = db.Close()
			_, _ = admin.ExecContext(c, "DROP TABLE IF EXISTS "+records+", "+records+"_migrations, "+orders+", "+handKeys)
			_ = admin.Close()
		}
		if pid := findProcess("mariadbd", "mysqld"); pid > 0 {
			t.dbCPU = func(context.Context) int64 { return procCPU(pid) }
		}
		if _, err := db.ExecContext(ctx, "CREATE TABLE "+orders+" (id BIGINT AUTO_INCREMENT PRIMARY KEY, item VARCHAR(255) NOT NULL, qty INT NOT NULL, created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE=InnoDB"); err != nil {
			t.close()
			return nil, err
		}
		st, err := mysqlstore.New(db, &mysqlstore.Config{Table: records})
		if err == nil {
			err = st.Migrate(ctx)
		}
		if err != nil {
			t.close()
			return nil, err
		}
		if mc.MultiStatements {
			hand, err := newHandMySQL(ctx, db, orders, handKeys)
			if err != nil {
				t.close()
				return nil, err
			}
			t.hand, t.handOnly = hand, true
		}
		t.backend, t.store = &mysqlBackend{db: db, admin: admin, table: orders}, "mysqlstore, same database"
		store, singleTx = st, true
	case "redis":
		opt, err := redis.ParseURL(cfg.RedisURL)
		if err != nil {
			return nil, fmt.Errorf("redis: %w", err)
		}
		t.wire = &wireCounter{proto: protoRedis}
		opt.Dialer = t.wire.dial
		rdb := redis.NewClient(opt)
		pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		info, err := rdb.InfoMap(pctx, "server").Result()
		cancel()
		if err != nil {
			_ = rdb.Close()
			return nil, unavailable("redis at %s: %v", opt.Addr, err)
		}
		t.version = "Redis " + info["Server"]["redis_version"]
		prefix := "idembench_" + suffix + ":"
		t.close = func() {
			c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			iter := rdb.Scan(c, 0, prefix+"*", 1000).Iterator()
			var batch []string
			for iter.Next(c) {
				batch = append(batch, iter.Val())
				if len(batch) == 1000 {
					rdb.Unlink(c, batch...)
					batch = batch[:0]
				}
			}
			if len(batch) > 0 {
				rdb.Unlink(c, batch...)
			}
			_ = rdb.Close()
		}
		st, err := redisstore.New(rdb, &redisstore.Config{Prefix: prefix})
		if err != nil {
			t.close()
			return nil, err
		}
		if pid := findProcess("redis-server"); pid > 0 {
			t.dbCPU = func(context.Context) int64 { return procCPU(pid) }
		}
		t.backend, t.store = newMemBackend(), "redisstore (not transactional)"
		store = st
	default:
		return nil, fmt.Errorf("unknown store %q; use memory, sqlite, postgres, mysql or redis", name)
	}
	if err := serveIdem(t, store, singleTx); err != nil {
		t.close()
		return nil, err
	}
	return t, nil
}

func isUnavailable(err error) bool {
	var u errUnavailable
	return errors.As(err, &u)
}

// profileLabels runs every request of h under the pprof label variant=NAME,
// the variant its path and its key's tag (keyGen) say it belongs to ("other"
// for the bookkeeping requests), so that one CPU profile of a server serving
// every variant splits by variant: go tool pprof -tagfocus 'variant=^first$'. Only
// for profiled runs (CPUProfileEnv): the labels are made once, not per request,
// but the lookup is work the measured server does not otherwise do.
func profileLabels(h http.Handler, variants []variant) http.Handler {
	type route struct {
		path string
		tag  uint16 // keyGen's tag; 0 for a request without a key
	}
	names := make(map[route]context.Context, len(variants))
	for _, v := range variants {
		var tag uint16
		switch v.keys {
		case keysFresh:
			tag = tagFresh
		case keysPool:
			tag = tagPool
		case keysHot:
			tag = tagHot
		}
		names[route{v.path, tag}] = pprof.WithLabels(context.Background(), pprof.Labels("variant", v.name))
	}
	other := pprof.WithLabels(context.Background(), pprof.Labels("variant", "other"))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tag, _ := keyTag(r.Header.Get("Idempotency-Key"))
		labels, ok := names[route{r.URL.Path, tag}]
		if !ok {
			labels = other
		}
		// Not reset afterwards: net/http flushes the answer after ServeHTTP
		// returns, on this goroutine, and that write belongs to this variant too.
		pprof.SetGoroutineLabels(labels)
		h.ServeHTTP(w, r)
	})
}
