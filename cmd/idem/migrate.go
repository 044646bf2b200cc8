package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
)

func init() {
	register(&command{
		name:    "migrate",
		summary: "create or upgrade the key records' table (and the demo's orders table) in a database",
		run:     runMigrate,
	})
}

const migrateUsage = `Usage: idem migrate --db URL [flags]

Creates or upgrades the table that keeps idempotency key records (the store's
embedded migrations; safe to run again, and from several processes at once), and
the orders table of the reference service (idem demo). Run it at deploy time, or
let your service call the store's Migrate at start-up.

Example:
  idem migrate --db postgres://postgres@127.0.0.1:5432/app
  idem migrate --db sqlite:idem-demo.db
  idem migrate --db mysql://root@127.0.0.1:3306/app --orders=false

Exit codes: 0 migrated, 1 the database failed, 2 bad usage.

Flags:
`

var storeCmdEnv = []storeEnvVar{{"db", "IDEM_DB"}, {"keys", "IDEM_KEYS"}, {"table", "IDEM_TABLE"}}

// storeFlags declares the flags every store command shares.
func storeFlags(fs *flag.FlagSet, dbDefault string) (db, keys, table *string) {
	db = fs.String("db", dbDefault, "the database: sqlite:PATH, postgres://… or mysql://USER@HOST:PORT/DB")
	keys = fs.String("keys", "", "where the key records live: empty for the --db database, or redis://HOST:PORT/N")
	table = fs.String("table", "", "the key records' table (or Redis key prefix); empty for the store's default (idem_records, idem:)")
	return db, keys, table
}

func runMigrate(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem migrate", flag.ContinueOnError)
	db, keys, table := storeFlags(fs, "")
	withOrders := fs.Bool("orders", true, "also create the orders table of idem demo")
	fs.Usage = storeUsage(fs, migrateUsage, storeCmdEnv)
	pos, code, ok := storeParse(fs, args, storeCmdEnv, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) > 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("unexpected argument %q; idem migrate takes flags only", pos[0]))
	}
	if *db == "" {
		return storeUsageError(stderr, fs, "--db is required; for example --db sqlite:idem-demo.db or --db postgres://…")
	}
	opts := dbopen.Options{DB: *db, Keys: *keys, KeyTable: *table}
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
	if *withOrders {
		svc, err := orders.New(h.Orders, nil)
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
