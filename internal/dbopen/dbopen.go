package dbopen

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// DefaultDB is the --db of `idem demo` when none is given: an embedded SQLite
// file in the working directory.
const DefaultDB = "sqlite:idem-demo.db"

// Target is a parsed --db value.
type Target struct {
	// Dialect is the database's SQL dialect.
	Dialect orders.Dialect
	// Path is the SQLite file (SQLite only).
	Path string
	// URL is the PostgreSQL connection URL (PostgreSQL only), passed to pgxpool.
	URL string
	// DSN is the go-sql-driver/mysql data source name (MySQL only), with
	// parseTime=true.
	DSN string
	// Display is the value with any password replaced by "xxxxx", fit for logs.
	Display string
}

// ParseDB parses a --db value:
//
//	sqlite:PATH or sqlite://PATH          an embedded SQLite file (created if missing)
//	postgres://… or postgresql://…       PostgreSQL, any pgx connection URL
//	mysql://USER[:PASS]@HOST[:PORT]/DB    MySQL or MariaDB; query parameters are
//	                                      passed to go-sql-driver/mysql
//
// Errors start with "--db:" and say what to write instead.
func ParseDB(raw string) (Target, error) {
	raw = strings.TrimSpace(raw)
	if raw == "" {
		return Target{}, errors.New("--db is empty; use sqlite:PATH, postgres://… or mysql://…")
	}
	scheme, rest, ok := strings.Cut(raw, ":")
	if !ok || strings.ContainsAny(scheme, `/\.`) {
		return Target{}, fmt.Errorf("--db %q has no scheme; use sqlite:%s, postgres://… or mysql://…", raw, raw)
	}
	switch strings.ToLower(scheme) {
	case "sqlite", "sqlite3":
		path := strings.TrimPrefix(rest, "//")
		if path == "" {
			return Target{}, errors.New("--db: sqlite: needs a file path, for example sqlite:idem-demo.db or sqlite:///var/lib/idem/idem.db")
		}
		if path == ":memory:" || strings.HasPrefix(path, "file:") || strings.Contains(path, "mode=memory") {
			return Target{}, fmt.Errorf("--db: %q: in-memory and URI databases are not supported (every pooled connection would see its own); use a file path such as sqlite:idem-demo.db", raw)
		}
		return Target{Dialect: orders.SQLite, Path: path, Display: "sqlite:" + path}, nil
	case "postgres", "postgresql":
		if _, err := pgxpool.ParseConfig(raw); err != nil {
			return Target{}, fmt.Errorf("--db: not a valid PostgreSQL URL (%v); use postgres://USER[:PASS]@HOST:PORT/DB?sslmode=disable", redactErr(err, raw))
		}
		return Target{Dialect: orders.Postgres, URL: raw, Display: redact(raw)}, nil
	case "mysql", "mariadb":
		dsn, err := mysqlDSN(raw)
		if err != nil {
			return Target{}, err
		}
		return Target{Dialect: orders.MySQL, DSN: dsn, Display: redact(raw)}, nil
	}
	return Target{}, fmt.Errorf("--db: unknown scheme %q; use sqlite:PATH, postgres://… or mysql://…", scheme)
}

// mysqlDSN converts mysql://user:pass@host:port/db?params into a go-sql-driver
// DSN with parseTime=true.
func mysqlDSN(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("--db: not a valid MySQL URL (%v); use mysql://USER[:PASS]@HOST:PORT/DB", redactErr(err, raw))
	}
	db := strings.TrimPrefix(u.Path, "/")
	if u.Host == "" || db == "" || strings.Contains(db, "/") {
		return "", fmt.Errorf("--db %s: name the server and the database, as in mysql://root@127.0.0.1:3306/test", redact(raw))
	}
	cfg := mysql.NewConfig()
	cfg.User = u.User.Username()
	cfg.Passwd, _ = u.User.Password()
	cfg.Net = "tcp"
	cfg.Addr = u.Host
	if u.Port() == "" {
		cfg.Addr = net.JoinHostPort(u.Hostname(), "3306")
	}
	cfg.DBName = db
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	// Query parameters are go-sql-driver options (tls=true, timeout=5s, …).
	dsn := cfg.FormatDSN()
	if q := u.Query(); len(q) > 0 {
		q.Del("parseTime")
		if enc := q.Encode(); enc != "" {
			if strings.Contains(dsn, "?") {
				dsn += "&" + enc
			} else {
				dsn += "?" + enc
			}
		}
	}
	if _, err := mysql.ParseDSN(dsn); err != nil {
		return "", fmt.Errorf("--db %s: %v; see the go-sql-driver/mysql DSN parameters", redact(raw), err)
	}
	return dsn, nil
}

// redact hides the password of a URL.
func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.User == nil {
		return raw
	}
	return u.Redacted()
}

// redactErr returns err's message with raw's password hidden.
func redactErr(err error, raw string) string {
	msg := err.Error()
	if u, perr := url.Parse(raw); perr == nil && u.User != nil {
		if p, ok := u.User.Password(); ok && p != "" {
			msg = strings.ReplaceAll(msg, p, "xxxxx")
		}
	}
	return msg
}

// Options says what to open.
type Options struct {
	// DB is the business database (--db): orders, and the key records unless Keys
	// is set. Defaults to DefaultDB.
	DB string
	// Keys is where the key records live (--keys): empty to follow DB, or
	// redis://HOST:PORT/N (rediss:// for TLS).
	Keys string
	// KeyTable is the key records' table in a SQL database, or the key prefix in
	// Redis. Defaults to the store's default ("idem_records", "idem:").
	KeyTable string
}

// Check parses DB and Keys without connecting, so that a command can report a
// bad URL as a usage error before it touches a network.
func (o Options) Check() error {
	db := o.DB
	if db == "" {
		db = DefaultDB
	}
	if _, err := ParseDB(db); err != nil {
		return err
	}
	_, err := parseKeys(o.Keys)
	return err
}

// parseKeys parses --keys: nil options mean "follow the database".
func parseKeys(raw string) (*redis.Options, error) {
	if raw == "" {
		return nil, nil
	}
	scheme, _, _ := strings.Cut(raw, ":")
	switch strings.ToLower(scheme) {
	case "redis", "rediss":
		opts, err := redis.ParseURL(raw)
		if err != nil {
			return nil, fmt.Errorf("--keys: not a valid Redis URL (%v); use redis://HOST:PORT/DB", redactErr(err, raw))
		}
		return opts, nil
	}
	return nil, fmt.Errorf("--keys: unknown scheme %q; leave --keys empty to keep the keys in the --db database, or use redis://HOST:PORT/DB", scheme)
}

// Handle is an opened business database with its idem store.
type Handle struct {
	// Target is the parsed --db.
	Target Target
	// SQL is the business database for SQLite and MySQL; nil for PostgreSQL.
	SQL *sql.DB
	// Pool is the business database for PostgreSQL; nil otherwise.
	Pool *pgxpool.Pool
	// Redis is the client of --keys redis://…; nil when the keys follow the database.
	Redis *redis.Client
	// Store is the idem store. It implements idem.TxStore when the keys live in the
	// business database.
	Store idem.Store
	// Orders is the orders service's view of the database: it writes in the store's
	// transaction when there is one.
	Orders orders.Backend
	// KeysAt describes where the key records are, for messages: "table idem_records
	// of sqlite:idem-demo.db" or "redis://127.0.0.1:6379/0".
	KeysAt string

	closers []func() error
}

// Open connects to the databases named in opts, checks that they answer, and
// builds the store. It does not create any table: call Migrate. Close the Handle
// when done.
func Open(ctx context.Context, opts Options) (h *Handle, err error) {
	if opts.DB == "" {
		opts.DB = DefaultDB
	}
	t, err := ParseDB(opts.DB)
	if err != nil {
		return nil, err
	}
	redisOpts, err := parseKeys(opts.Keys)
	if err != nil {
		return nil, err
	}
	h = &Handle{Target: t}
	defer func() {
		if err != nil {
			_ = h.Close()
			h = nil
		}
	}()
	pingCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()

	transactional := redisOpts == nil
	switch t.Dialect {
	case orders.SQLite:
		db, err := embedded.Open(t.Path)
		if err != nil {
			return h, fmt.Errorf("--db %s: %w", t.Display, err)
		}
		h.SQL = db
		h.closers = append(h.closers, db.Close)
		if transactional {
			s, serr := sqlitestore.New(db, &sqlitestore.Config{Table: opts.KeyTable})
			if serr != nil {
				return h, serr
			}
			h.Store = s
			h.KeysAt = "table " + s.Table() + " of " + t.Display
			h.Orders, err = orders.SQL(db, orders.SQLite, sqlitestore.Tx)
		} else {
			h.Orders, err = orders.SQL(db, orders.SQLite, nil)
		}
		if err != nil {
			return h, err
		}
	case orders.Postgres:
		cfg, err := pgxpool.ParseConfig(t.URL)
		if err != nil {
			return h, fmt.Errorf("--db: %v", redactErr(err, t.URL))
		}
		if !strings.Contains(t.URL, "pool_max_conns") && cfg.MaxConns < 16 {
			cfg.MaxConns = 16 // a claim and a transaction per request in flight
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			return h, fmt.Errorf("--db %s: %v", t.Display, redactErr(err, t.URL))
		}
		h.Pool = pool
		h.closers = append(h.closers, func() error { pool.Close(); return nil })
		if err := pool.Ping(pingCtx); err != nil {
			return h, fmt.Errorf("--db %s: PostgreSQL does not answer (%v); check that it runs and that the URL, user and database are right", t.Display, redactErr(err, t.URL))
		}
		if transactional {
			s, serr := pgstore.New(pool, &pgstore.Config{Table: opts.KeyTable})
			if serr != nil {
				return h, serr
			}
			h.Store = s
			h.KeysAt = "table " + s.Table() + " of " + t.Display
			h.Orders, err = orders.Pgx(pool, pgstore.Tx)
		} else {
			h.Orders, err = orders.Pgx(pool, nil)
		}
		if err != nil {
			return h, err
		}
	case orders.MySQL:
		db, err := sql.Open("mysql", t.DSN)
		if err != nil {
			return h, fmt.Errorf("--db %s: %w", t.Display, err)
		}
		db.SetMaxOpenConns(32)
		db.SetMaxIdleConns(32)
		db.SetConnMaxLifetime(5 * time.Minute)
		h.SQL = db
		h.closers = append(h.closers, db.Close)
		if err := db.PingContext(pingCtx); err != nil {
			return h, fmt.Errorf("--db %s: MySQL does not answer (%v); check that it runs and that the URL, user and database are right", t.Display, redactErr(err, t.DSN))
		}
		if transactional {
			s, serr := mysqlstore.New(db, &mysqlstore.Config{Table: opts.KeyTable})
			if serr != nil {
				return h, serr
			}
			h.closers = append(h.closers, s.Close) // before db.Close: closers run in reverse
			h.Store = s
			h.KeysAt = "table " + s.Table() + " of " + t.Display
			h.Orders, err = orders.SQL(db, orders.MySQL, mysqlstore.Tx)
		} else {
			h.Orders, err = orders.SQL(db, orders.MySQL, nil)
		}
		if err != nil {
			return h, err
		}
	}

	if redisOpts != nil {
		client := redis.NewClient(redisOpts)
		h.Redis = client
		h.closers = append(h.closers, client.Close)
		if err := client.Ping(pingCtx).Err(); err != nil {
			return h, fmt.Errorf("--keys %s: Redis does not answer (%v); check that it runs and that the URL is right", redact(opts.Keys), redactErr(err, opts.Keys))
		}
		s, err := redisstore.New(client, &redisstore.Config{Prefix: opts.KeyTable})
		if err != nil {
			return h, err
		}
		h.Store = s
		h.KeysAt = redact(opts.Keys)
	}
	return h, nil
}

// Migrate creates or upgrades the key records' table; Redis needs none. The
// orders table is the orders service's: see orders.Service.Migrate.
func (h *Handle) Migrate(ctx context.Context) error {
	m, ok := h.Store.(interface{ Migrate(context.Context) error })
	if !ok {
		return nil
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate the key records: %w", err)
	}
	return nil
}

// Transactional reports whether orders and key records commit in one
// transaction (the keys live in the business database).
func (h *Handle) Transactional() bool {
	_, ok := h.Store.(idem.TxStore)
	return ok
}

// Close closes everything Open opened, last opened first. It is safe to call
// twice.
func (h *Handle) Close() error {
	var errs []error
	for i := len(h.closers) - 1; i >= 0; i-- {
		if err := h.closers[i](); err != nil {
			errs = append(errs, err)
		}
	}
	h.closers = nil
	return errors.Join(errs...)
}
