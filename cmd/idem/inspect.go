package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
)

func init() {
	register(&command{
		name:    "inspect",
		summary: "show the stored record of one idempotency key: why was this request replayed?",
		run:     runInspect,
	})
}

const inspectUsage = `Usage: idem inspect --db URL --scope TENANT KEY [flags]

Shows the record idem keeps for (scope, key): its state, age, lease, expiry,
request fingerprint, and the stored status, headers, body size and resource
reference, with what the next request with this key will get. Use it when a
client asks why a request was replayed (or answered 409 or 422).

The scope is the tenant the service put the request under (in idem demo, the
bearer token). Quote keys that start with "-" after "--".

Example:
  idem inspect --db sqlite:idem-demo.db --scope t1 8e03978e-40d5-43e8-bc93-6894a57f9324
  idem inspect --db postgres://postgres@127.0.0.1:5432/app --scope acme --body -- -odd-key

Exit codes: 0 a record exists, 1 no record (never used, or expired) or the
database failed, 2 bad usage.

Flags:
`

func runInspect(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem inspect", flag.ContinueOnError)
	db, keys, table := storeFlags(fs, "")
	scope := fs.String("scope", "", "the tenant or principal the key belongs to (idem demo: the bearer token); empty for unscoped services")
	showBody := fs.Bool("body", false, "also print the stored response body")
	fs.Usage = storeUsage(fs, inspectUsage, storeCmdEnv)
	pos, code, ok := storeParse(fs, args, storeCmdEnv, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) != 1 {
		return storeUsageError(stderr, fs, fmt.Sprintf("give exactly one KEY (got %d arguments); for example idem inspect --db sqlite:idem-demo.db --scope t1 KEY", len(pos)))
	}
	if *db == "" {
		return storeUsageError(stderr, fs, "--db is required; for example --db sqlite:idem-demo.db or --db postgres://…")
	}
	key, err := idem.ParseKey(pos[0], 1<<16)
	if err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	opts := dbopen.Options{DB: *db, Keys: *keys, KeyTable: *table}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	h, err := dbopen.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "idem inspect: %v\n", err)
		return exitFailure
	}
	defer h.Close()
	now := time.Now()
	rec, err := h.Store.Get(ctx, idem.StoredScope(*scope), key, now) // the form the middleware stored it under
	if errors.Is(err, idem.ErrNotFound) {
		fmt.Fprintf(stdout, "no record for key %q in scope %q (%s): it was never used, or it expired and the next request with it runs afresh\n", key, *scope, h.KeysAt)
		return exitFailure
	}
	if err != nil {
		fmt.Fprintf(stderr, "idem inspect: %v\n", err)
		if h.Redis == nil {
			fmt.Fprintln(stderr, "idem inspect: if the table does not exist, run `idem migrate` with the same --db first")
		}
		return exitFailure
	}
	inspectPrint(stdout, rec, now, *showBody)
	return exitOK
}

// inspectPrint writes rec for a human.
func inspectPrint(w io.Writer, rec *idem.Record, now time.Time, showBody bool) {
	ts := func(t time.Time) string { return t.UTC().Format(time.RFC3339Nano) }
	ago := func(d time.Duration) string { return d.Round(time.Millisecond).String() }
	line := func(name, format string, args ...any) {
		fmt.Fprintf(w, "%-12s %s\n", name+":", fmt.Sprintf(format, args...))
	}
	line("scope", "%q (as stored)", rec.Scope)
	line("key", "%q", rec.Key)
	line("state", "%s", rec.State)
	line("age", "%s (created %s)", ago(now.Sub(rec.CreatedAt)), ts(rec.CreatedAt))
	switch {
	case rec.State == idem.StateComplete:
		line("lease", "none (complete)")
	case rec.LeaseUntil.After(now):
		line("lease", "%s left (until %s)", ago(rec.LeaseUntil.Sub(now)), ts(rec.LeaseUntil))
	default:
		line("lease", "lapsed %s ago (%s): the holder crashed or stalled", ago(now.Sub(rec.LeaseUntil)), ts(rec.LeaseUntil))
	}
	line("expires in", "%s (at %s)", ago(rec.ExpiresAt.Sub(now)), ts(rec.ExpiresAt))
	line("fingerprint", "%s", rec.Fingerprint)
	if r := rec.Response; r != nil {
		line("status", "%d", r.Status)
		names := make([]string, 0, len(r.Header))
		for k := range r.Header {
			names = append(names, k)
		}
		sort.Strings(names)
		if len(names) == 0 {
			line("headers", "none")
		}
		for i, k := range names {
			label := "headers"
			if i > 0 {
				label = ""
			}
			for _, v := range r.Header[k] {
				if label == "" {
					fmt.Fprintf(w, "%-12s %s: %s\n", "", k, v)
				} else {
					line(label, "%s: %s", k, v)
					label = ""
				}
			}
		}
		if r.BodyOmitted {
			line("body", "not stored (kept as a reference or marker, or larger than MaxStoredBody)")
		} else {
			line("body", "%d bytes", len(r.Body))
		}
		ref := r.Ref
		if ref == "" {
			ref = "none"
		}
		line("ref", "%s", ref)
	}
	fmt.Fprintln(w)
	switch {
	case rec.State == idem.StateComplete:
		fmt.Fprintf(w, "A retry with the same method, path and body is answered with this stored %d\n(Idempotent-Replayed: true) until the record expires; a different request\nwith this key gets 422 idempotency_key_reused.\n", rec.Response.Status)
	case rec.LeaseUntil.After(now):
		fmt.Fprintln(w, "A request is running with this key: a retry gets 409 idempotency_key_in_use\nwith Retry-After until it completes or its lease lapses.")
	default:
		fmt.Fprintln(w, "The request holding this key stopped renewing its lease: the next retry with\nthe same request takes the key over and runs the handler again.")
	}
	if showBody && rec.Response != nil && !rec.Response.BodyOmitted {
		fmt.Fprintln(w)
		fmt.Fprintln(w, strings.TrimRight(string(rec.Response.Body), "\n"))
	}
}
