package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"strings"

	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
)

func init() {
	register(&command{
		name:    "migrate",
		summary: "create or upgrade the key records' table in a database (the demo's orders table only with --with-demo-orders)",
		run:     runMigrate,
	})
}

const migrateUsage = `Usage: idem migrate --db URL [flags]

Creates or upgrades the table that keeps idempotency key records (the store's
embedded migrations; safe to run again, and from several processes at once).
Run it at deploy time, or let your service call the store's Migrate at start-up.
It never touches a table of yours: an existing "orders" table is left alone.

It creates the key records' table idem demo would use with the same flags:
"idem_records" (and "idem_records_migrations" on MySQL, "idem_migrations" on
SQLite); --prefix puts a prefix on the names, --schema (PostgreSQL) puts them in
a schema of its own, created if missing; --table names the key records' table
alone. --with-demo-orders also creates the "orders" table of the reference
service (idem demo creates it itself at start, so this is only for preparing a
demo database ahead of time).

Example:
  idem migrate --db postgres://postgres@127.0.0.1:5432/app
  idem migrate --db postgres://postgres@127.0.0.1:5432/app --schema shop
  idem migrate --db mysql://root@127.0.0.1:3306/app --table billing_keys
  idem migrate --db sqlite:idem-demo.db --prefix demo_ --with-demo-orders

Exit codes: 0 migrated, 1 the database failed, 2 bad usage.

Flags:
`

// storeCmdEnv maps the flags of storeFlags to their environment variables.
var storeCmdEnv = []storeEnvVar{{"db", "IDEM_DB"}, {"keys", "IDEM_KEYS"}, {"table", "IDEM_TABLE"}}

// storeNameEnv is storeCmdEnv with the flags of storeNameFlags, the variables
// idem demo reads too.
var storeNameEnv = append(append([]storeEnvVar{}, storeCmdEnv...), storeEnvVar{"prefix", "IDEM_PREFIX"}, storeEnvVar{"schema", "IDEM_SCHEMA"})

// storeFlags declares the flags every store command shares.
func storeFlags(fs *flag.FlagSet, dbDefault string) (db, keys, table *string) {
	db = fs.String("db", dbDefault, "the database: sqlite:PATH, postgres://… or mysql://USER@HOST:PORT/DB")
	keys = fs.String("keys", "", "where the key records live: empty for the --db database, or redis://HOST:PORT/N")
	table = fs.String("table", "", "the key records' table (or Redis key prefix); empty for the store's default (idem_records, idem:)")
	return db, keys, table
}

// storeNameFlags declares --prefix and --schema, which name the tables as idem
// demo's flags of the same names do.
func storeNameFlags(fs *flag.FlagSet) (prefix, schema *string) {
	prefix = fs.String("prefix", "", "prefix of the tables' names, as in idem demo: PREFIXorders and PREFIXidem_records (lower-case letters, digits, _)")
	schema = fs.String("schema", "", "PostgreSQL only: the schema both tables live in, as in idem demo (on MySQL name another database in --db)")
	return prefix, schema
}

// storeFailure reports err of a store command that opened h, adding the advice
// to migrate unless the error already gives it.
func storeFailure(stderr io.Writer, name string, err error, h *dbopen.Handle) {
	// The library's errors start with "idem: "; after "idem gc: " it is noise.
	fmt.Fprintf(stderr, "%s: %s\n", name, strings.TrimPrefix(err.Error(), "idem: "))
	if h != nil && h.Redis == nil && !strings.Contains(err.Error(), "idem migrate") {
		fmt.Fprintf(stderr, "%s: if the table does not exist, run `idem migrate` with the same --db (and --prefix, --schema, --table) first\n", name)
	}
}

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem migrate", flag.ContinueOnError)
	db, keys, table := storeFlags(fs, "")
	prefix, schema := storeNameFlags(fs)
	withOrders := fs.Bool("with-demo-orders", false, "also create the orders table of idem demo (PREFIXorders); never needed by your own service")
	// --orders was the name (default true) before migrate stopped creating the
	// demo's table unless asked; it stays accepted so scripts that pass
	// --orders=false keep working.
	fs.BoolVar(withOrders, "orders", false, "deprecated: the old name of --with-demo-orders")
	fs.Usage = storeUsage(fs, migrateUsage, storeNameEnv)
	pos, code, ok := parseFlags(fs, args, storeNameEnv, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) > 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("unexpected argument %q; idem migrate takes flags only", pos[0]))
	}
	if *db == "" {
		return storeUsageError(stderr, fs, "--db is required; for example --db sqlite:idem-demo.db or --db postgres://…")
	}
	opts := dbopen.Options{DB: *db, Keys: *keys, KeyTable: *table, Prefix: *prefix, Schema: *schema}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	h, err := dbopen.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "idem migrate: %v\n", err)
		return exitFailure
	}
	defer h.Close()
	if err := h.Migrate(ctx); err != nil {
		fmt.Fprintf(stderr, "idem migrate: %v\n", err)
		return exitFailure
	}
	if h.Redis != nil {
		fmt.Fprintf(stdout, "key records: %s needs no schema\n", h.KeysAt)
	} else {
		fmt.Fprintf(stdout, "key records: ready (%s)\n", h.KeysAt)
	}
	if st, ok := h.Store.(interface{ StepsTable() string }); ok {
		fmt.Fprintf(stdout, "step records: ready (table %s)\n", st.StepsTable())
	}
	if *withOrders {
		svc, err := orders.New(h.Orders, &orders.Config{Table: h.OrdersTable})
		if err == nil {
			err = svc.Migrate(ctx)
		}
		if err != nil {
			fmt.Fprintf(stderr, "idem migrate: %v\n", err)
			return exitFailure
		}
		fmt.Fprintf(stdout, "orders:      ready (table %s of %s)\n", svc.Table(), h.Target.Display)
	}
	if err := h.Close(); err != nil {
		fmt.Fprintf(stderr, "idem migrate: closing the database: %v\n", err)
		return exitFailure
	}
	return exitOK
}
