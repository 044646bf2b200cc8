package dbopen

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"net/url"
	"os"
	"regexp"
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
//	USER[:PASS]@tcp(HOST:PORT)/DB         the same in go-sql-driver/mysql's DSN form
//	                                      (also after mysql://), as the Go examples
//	                                      take it
//
// Errors start with "--db" and say what to write instead.
func ParseDB(raw string) (Target, error) { return ParseDBFlag("--db", raw) }

// ParseDBFlag is ParseDB for a flag of another name (such as --postgres or
// --mysql of idem bench): its errors start with flag.
func ParseDBFlag(flag, raw string) (Target, error) {
	raw = strings.TrimSpace(raw)
	if raw == "" {
		return Target{}, fmt.Errorf("%s is empty; use sqlite:PATH, postgres://… or mysql://…", flag)
	}
	// The go-sql-driver form the Go examples use ("root@tcp(127.0.0.1:3306)/test",
	// also after "mysql://") names the same database as the URL form.
	if dsn := strings.TrimPrefix(strings.TrimPrefix(raw, "mysql://"), "mariadb://"); !strings.Contains(dsn, "://") && (strings.Contains(dsn, "@tcp(") || strings.HasPrefix(dsn, "tcp(")) {
		return mysqlFromDSN(flag, dsn)
	}
	scheme, rest, ok := strings.Cut(raw, ":")
	if !ok || strings.ContainsAny(scheme, `/\.@(`) {
		return Target{}, fmt.Errorf("%s %q has no scheme; use sqlite:%s, postgres://… or mysql://…", flag, raw, raw)
	}
	switch strings.ToLower(scheme) {
	case "sqlite", "sqlite3":
		path := strings.TrimPrefix(rest, "//")
		if path == "" {
			return Target{}, fmt.Errorf("%s: sqlite: needs a file path, for example sqlite:idem-demo.db or sqlite:///var/lib/idem/idem.db", flag)
		}
		if path == ":memory:" || strings.HasPrefix(path, "file:") || strings.Contains(path, "mode=memory") {
			return Target{}, fmt.Errorf("%s: %q: in-memory and URI databases are not supported (every pooled connection would see its own); use a file path such as sqlite:idem-demo.db", flag, raw)
		}
		return Target{Dialect: orders.SQLite, Path: path, Display: "sqlite:" + path}, nil
	case "postgres", "postgresql":
		if _, err := pgxpool.ParseConfig(raw); err != nil {
			return Target{}, fmt.Errorf("%s: not a valid PostgreSQL URL (%v); use postgres://USER[:PASS]@HOST:PORT/DB?sslmode=disable", flag, redactErr(err, raw))
		}
		return Target{Dialect: orders.Postgres, URL: raw, Display: redact(raw)}, nil
	case "mysql", "mariadb":
		dsn, err := mysqlDSN(flag, raw)
		if err != nil {
			return Target{}, err
		}
		return Target{Dialect: orders.MySQL, DSN: dsn, Display: redact(raw)}, nil
	}
	return Target{}, fmt.Errorf("%s: unknown scheme %q; use sqlite:PATH, postgres://… or mysql://…", flag, scheme)
}

// mysqlDSN converts mysql://user:pass@host:port/db?params into a go-sql-driver
// DSN with parseTime=true.
func mysqlDSN(flag, raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", fmt.Errorf("%s: not a valid MySQL URL (%v); use mysql://USER[:PASS]@HOST:PORT/DB", flag, redactErr(err, raw))
	}
	db := strings.TrimPrefix(u.Path, "/")
	if u.Host == "" || db == "" || strings.Contains(db, "/") {
		return "", fmt.Errorf("%s %s: name the server and the database, as in mysql://root@127.0.0.1:3306/test", flag, redact(raw))
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
		return "", fmt.Errorf("%s %s: %v; see the go-sql-driver/mysql DSN parameters", flag, redact(raw), err)
	}
	return dsn, nil
}

// mysqlFromDSN is the Target of a go-sql-driver/mysql DSN over TCP, with
// parseTime=true and UTC as a URL would give; its Display is the URL form.
func mysqlFromDSN(flag, dsn string) (Target, error) {
	display, ok := MySQLURLFromDSN(dsn)
	if !ok {
		// Not parseable: show it with what may be a password hidden.
		display = dsn
		if at := strings.LastIndex(dsn, "@tcp("); at >= 0 {
			if user, _, hasPass := strings.Cut(dsn[:at], ":"); hasPass {
				display = user + ":xxxxx" + dsn[at:]
			}
		}
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err == nil && (cfg.Net != "tcp" || cfg.DBName == "") {
		err = errors.New("name the server and the database, as in root@tcp(127.0.0.1:3306)/test")
	}
	if err != nil {
		return Target{}, fmt.Errorf("%s %s: %v; see the go-sql-driver/mysql DSN parameters, or write a URL such as mysql://root@127.0.0.1:3306/test", flag, display, redactErr(err, dsn))
	}
	cfg.ParseTime = true
	cfg.Loc = time.UTC
	return Target{Dialect: orders.MySQL, DSN: cfg.FormatDSN(), Display: display}, nil
}

// MySQLURLFromDSN converts a go-sql-driver/mysql DSN over TCP
// ("root@tcp(127.0.0.1:3306)/test") into the mysql:// URL that ParseDB takes,
// with the password hidden; ok is false when dsn is not such a DSN.
func MySQLURLFromDSN(dsn string) (u string, ok bool) {
	if strings.Contains(dsn, "://") || !strings.Contains(dsn, "@tcp(") && !strings.HasPrefix(dsn, "tcp(") {
		return "", false
	}
	cfg, err := mysql.ParseDSN(dsn)
	if err != nil || cfg.Net != "tcp" || cfg.DBName == "" {
		return "", false
	}
	v := &url.URL{Scheme: "mysql", Host: cfg.Addr, Path: "/" + cfg.DBName}
	switch {
	case cfg.Passwd != "":
		v.User = url.UserPassword(cfg.User, "xxxxx")
	case cfg.User != "":
		v.User = url.User(cfg.User)
	}
	return v.String(), true
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
	// Redis. Defaults to the store's default ("idem_records", "idem:"), with
	// Prefix and Schema applied in a SQL database.
	KeyTable string
	// Prefix is put before the tables' names: PREFIXidem_records and PREFIXorders
	// (--prefix). Lower-case letters, digits and underscores.
	Prefix string
	// Schema is the PostgreSQL schema both tables live in (--schema); Migrate
	// creates it if missing. PostgreSQL only: on MySQL a schema is a database.
	Schema string
	// MustExist makes Open fail, with advice, when the SQLite file does not exist,
	// instead of creating an empty one: for commands that read or clean up.
	MustExist bool
}

// nameRE is what Prefix and Schema accept: lower-case SQL identifier characters,
// so that quoted (store) and unquoted (orders) names agree.
var nameRE = regexp.MustCompile(`^[a-z_][a-z0-9_]*$`)

// checkNames validates Prefix and Schema against the database's dialect.
func (o Options) checkNames(t Target) error {
	if o.Prefix != "" && (!nameRE.MatchString(o.Prefix) || len(o.Prefix) > 32) {
		return fmt.Errorf("--prefix %q is not usable; use up to 32 lower-case letters, digits and underscores, not starting with a digit, such as demo_", o.Prefix)
	}
	if o.Schema != "" && (!nameRE.MatchString(o.Schema) || len(o.Schema) > 63) {
		return fmt.Errorf("--schema %q is not usable; use up to 63 lower-case letters, digits and underscores, not starting with a digit, such as shop", o.Schema)
	}
	if o.Schema != "" && t.Dialect != orders.Postgres {
		return fmt.Errorf("--schema works on PostgreSQL only; on MySQL a schema is a database: name it in --db (mysql://USER@HOST/DB), and use --prefix for the table names (--db is %s)", t.Display)
	}
	return nil
}

// qualify applies Prefix and Schema to a table name.
func (o Options) qualify(name string) string {
	name = o.Prefix + name
	if o.Schema != "" {
		name = o.Schema + "." + name
	}
	return name
}

// keyTable is the key records' table (or Redis prefix) the store gets.
func (o Options) keyTable() string {
	if o.KeyTable == "" && o.Keys == "" {
		if o.Prefix != "" || o.Schema != "" {
			return o.qualify("idem_records")
		}
	}
	return o.KeyTable
}

// Check parses DB and Keys without connecting, so that a command can report a
// bad URL as a usage error before it touches a network.
func (o Options) Check() error {
	db := o.DB
	if db == "" {
		db = DefaultDB
	}
	t, err := ParseDB(db)
	if err != nil {
		return err
	}
	if err := o.checkNames(t); err != nil {
		return err
	}
	_, err = parseKeys(o.Keys)
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
		return ParseRedis("--keys", raw)
	}
	return nil, fmt.Errorf("--keys: unknown scheme %q; leave --keys empty to keep the keys in the --db database, or use redis://HOST:PORT/DB", scheme)
}

// ParseRedis parses the Redis URL of the named flag: redis://[USER:PASS@]HOST:PORT/DB,
// or rediss:// for TLS. Its errors start with flag.
func ParseRedis(flag, raw string) (*redis.Options, error) {
	raw = strings.TrimSpace(raw)
	scheme, _, _ := strings.Cut(raw, ":")
	if s := strings.ToLower(scheme); s != "redis" && s != "rediss" {
		return nil, fmt.Errorf("%s %q is not a Redis URL; use redis://HOST:PORT/DB, such as redis://127.0.0.1:6379/0", flag, redact(raw))
	}
	opts, err := redis.ParseURL(raw)
	if err != nil {
		return nil, fmt.Errorf("%s: not a valid Redis URL (%v); use redis://HOST:PORT/DB, such as redis://127.0.0.1:6379/0", flag, redactErr(err, raw))
	}
	return opts, nil
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
	// OrdersTable is the orders table with Options.Prefix and Schema applied,
	// for orders.Config.Table.
	OrdersTable string

	schema string

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
	if err := opts.checkNames(t); err != nil {
		return nil, err
	}
	redisOpts, err := parseKeys(opts.Keys)
	if err != nil {
		return nil, err
	}
	h = &Handle{Target: t, OrdersTable: opts.qualify(orders.DefaultTable), schema: opts.Schema}
	opts.KeyTable = opts.keyTable()
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
		if opts.MustExist {
			if _, err := os.Stat(t.Path); errors.Is(err, fs.ErrNotExist) {
				return h, fmt.Errorf("--db %s: the file %s does not exist; check the path (relative to the working directory), or create the database with `idem migrate --db %s`", t.Display, t.Path, t.Display)
			} else if err != nil {
				return h, fmt.Errorf("--db %s: %w", t.Display, err)
			}
		}
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

// Migrate creates the schema of Options.Schema if missing, and creates or
// upgrades the key records' table; Redis needs none. The orders table is the
// orders service's: see orders.Service.Migrate.
func (h *Handle) Migrate(ctx context.Context) error {
	if h.schema != "" && h.Pool != nil {
		if err := CreateSchema(ctx, h.Pool, h.schema); err != nil {
			return fmt.Errorf("create schema %s: %w (may this role create schemas? Or create it yourself)", h.schema, err)
		}
	}
	m, ok := h.Store.(interface{ Migrate(context.Context) error })
	if !ok {
		return nil
	}
	if err := m.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate the key records: %w", err)
	}
	return nil
}

// CreateSchema runs CREATE SCHEMA IF NOT EXISTS under a transaction-scoped
// advisory lock: two of them at once, on a schema that does not exist yet, can
// both try to create it, and one then fails with a unique violation in
// pg_namespace (idem migrate or idem demo started by several processes).
// schema must be a checked identifier.
func CreateSchema(ctx context.Context, pool *pgxpool.Pool, schema string) error {
	tx, err := pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock(hashtext('idem.schema.migrate'))"); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+schema); err != nil {
		return err
	}
	return tx.Commit(ctx)
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
