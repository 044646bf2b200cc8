package main

import (
	"context"
	"flag"
	"fmt"
	"io"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
)

func init() {
	register(&command{
		name:    "gc",
		summary: "delete expired idempotency key records, in batches",
		run:     runGC,
	})
}

const gcUsage = `Usage: idem gc --db URL [flags]

Deletes the key records that expired (older than the TTL they were stored with),
--batch at a time so that no statement holds locks for long, and prints how many
it deleted. Expired records already count as absent, so gc only reclaims space;
run it from cron, or let your service run idem.Janitor (idem demo does).
Redis expires records by itself: gc deletes nothing there.

Example:
  idem gc --db postgres://postgres@127.0.0.1:5432/app --batch 5000
  idem gc --db sqlite:idem-demo.db --prefix demo_

Exit codes: 0 done, 1 the database failed (what was deleted stays deleted), 2 bad usage.

Flags:
`

func runGC(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem gc", flag.ContinueOnError)
	db, keys, table := storeFlags(fs, "")
	prefix, schema := storeNameFlags(fs)
	batch := fs.Int("batch", 1000, "the most records one DELETE removes")
	fs.Usage = storeUsage(fs, gcUsage, storeNameEnv)
	pos, code, ok := parseFlags(fs, args, storeNameEnv, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) > 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("unexpected argument %q; idem gc takes flags only", pos[0]))
	}
	if *db == "" {
		return storeUsageError(stderr, fs, "--db is required; for example --db sqlite:idem-demo.db or --db postgres://…")
	}
	if *batch < 1 {
		return storeUsageError(stderr, fs, fmt.Sprintf("--batch %d is too small; use a positive number such as 1000", *batch))
	}
	opts := dbopen.Options{DB: *db, Keys: *keys, KeyTable: *table, Prefix: *prefix, Schema: *schema, MustExist: true}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	h, err := dbopen.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "idem gc: %v\n", err)
		return exitFailure
	}
	defer h.Close()
	j := &idem.Janitor{Store: h.Store, BatchSize: *batch}
	n, err := j.Sweep(ctx)
	if err != nil {
		storeFailure(stderr, "idem gc", err, h)
		fmt.Fprintf(stdout, "deleted %d expired key records before the error\n", n)
		return exitFailure
	}
	if _, self := h.Store.(interface{ ExpiresRecordsItself() bool }); self || h.Redis != nil {
		fmt.Fprintf(stdout, "deleted %d expired key records (Redis at %s expires records by itself)\n", n, h.KeysAt)
		return exitOK
	}
	fmt.Fprintf(stdout, "deleted %d expired key records (%s)\n", n, h.KeysAt)
	return exitOK
}
