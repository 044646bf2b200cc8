package main

import (
	"context"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders"
)

func init() {
	register(&command{
		name:    "inspect",
		summary: "show the stored record of one idempotency key: why was this request replayed?",
		run:     runInspect,
	})
}

const inspectUsage = `Usage: idem inspect --db URL --scope TENANT KEY [flags]
       idem inspect --db URL --summary

Shows the record idem keeps for (scope, key): its state, age, lease, expiry,
request fingerprint, and the stored status, headers, body size and resource
reference, with what the next request with this key will get. Use it when a
client asks why a request was replayed (or answered 409 or 422). Then come the
key's step records (idem.Step: calls to other services), each with its state
(started, done, failed), derived key, the fingerprint of the request it
belongs to (another request with the key gets 422) and recorded result: a
step started and never recorded is one whose outcome is unknown, which idem
resolve --step settles. A key without a record may still have steps (an attempt that died in
the single-transaction flow leaves its steps and no record).

With --summary (and no KEY) it counts the records by state instead — complete,
in flight, expired — and shows the oldest in-flight record and the in-flight
records whose lease lapsed (their holders crashed or stalled: the next retry
of each takes it over, or, where LapsedLease is LapsedRefuse as in idem proxy,
gets 503 until idem resolve settles it). It works on the SQL stores; Redis records expire by
themselves and are not counted.

The scope is the tenant the service put the request under (in idem demo, the
bearer token). Quote keys that start with "-" after "--".

Example:
  idem inspect --db sqlite:idem-demo.db --scope t1 8e03978e-40d5-43e8-bc93-6894a57f9324
  idem inspect --db postgres://postgres@127.0.0.1:5432/app --scope acme --body -- -odd-key
  idem inspect --db sqlite:idem-demo.db --summary
  idem inspect --db postgres://postgres@127.0.0.1:5432/app --schema shop --prefix p_ --scope t1 KEY

--prefix and --schema name the table as idem demo, migrate and gc do. A key
not found in --scope but kept under other scopes is named with them.

Exit codes: 0 a record or step records exist, 1 neither (never used, or
expired) or the database failed, 2 bad usage.

Flags:
`

func runInspect(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem inspect", flag.ContinueOnError)
	db, keys, table := storeFlags(fs, "")
	prefix, schema := storeNameFlags(fs)
	scope := fs.String("scope", "", "the tenant or principal the key belongs to (idem demo: the bearer token); empty for unscoped services")
	showBody := fs.Bool("body", false, "also print the stored response body")
	summary := fs.Bool("summary", false, "count the records by state and show those past their lease, instead of one KEY")
	fs.Usage = storeUsage(fs, inspectUsage, storeNameEnv)
	pos, code, ok := storeParse(fs, args, storeNameEnv, stdout, stderr)
	if !ok {
		return code
	}
	opts := dbopen.Options{DB: *db, Keys: *keys, KeyTable: *table, Prefix: *prefix, Schema: *schema, MustExist: true}
	if *summary {
		return runInspectSummary(ctx, fs, pos, opts, stdout, stderr)
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
	if err != nil && !errors.Is(err, idem.ErrNotFound) {
		storeFailure(stderr, "idem inspect", err, h)
		return exitFailure
	}
	var steps []idem.StepRecord
	if ss, ok := h.Store.(idem.StepStore); ok {
		if steps, err = ss.GetSteps(ctx, idem.StoredScope(*scope), key, now); err != nil {
			storeFailure(stderr, "idem inspect", err, h)
			return exitFailure
		}
	}
	if rec == nil {
		if len(steps) == 0 {
			fmt.Fprintf(stdout, "no record for key %q in scope %q (%s): it was never used, or it expired and the next request with it runs afresh\n", key, *scope, h.KeysAt)
			inspectOtherScopes(ctx, stdout, h, *scope, key, now)
			return exitFailure
		}
		// The single-transaction flow: the attempt that began the steps died
		// and its record rolled back, but the steps were committed on their own.
		fmt.Fprintf(stdout, "no record for key %q in scope %q (%s): no request with it is running or complete; the next one runs the handler, which finds these steps (a request other than the one they belong to gets 422 at the first of them).\n\n", key, *scope, h.KeysAt)
	} else {
		inspectPrint(stdout, rec, now, *showBody)
	}
	inspectPrintSteps(stdout, steps, now)
	return exitOK
}

// inspectPrintSteps writes the step records of a key's operation for a human.
func inspectPrintSteps(w io.Writer, steps []idem.StepRecord, now time.Time) {
	if len(steps) == 0 {
		return
	}
	fmt.Fprintln(w)
	unknown := false
	for _, st := range steps {
		fmt.Fprintf(w, "%-12s %q %s\n", "step:", st.Name, st.State)
		fmt.Fprintf(w, "%-12s %s\n", "  derived key", st.DerivedKey)
		if st.Fingerprint != "" {
			fmt.Fprintf(w, "%-12s %s (the request the step belongs to: one with another fingerprint gets 422 idempotency_key_reused)\n", "  request", st.Fingerprint)
		}
		fmt.Fprintf(w, "%-12s %s ago (%s), expires in %s\n", "  started", now.Sub(st.StartedAt).Round(time.Millisecond), st.StartedAt.UTC().Format(time.RFC3339Nano), st.ExpiresAt.Sub(now).Round(time.Second))
		switch st.State {
		case idem.StepStarted:
			if st.Owner == "" {
				fmt.Fprintf(w, "%-12s a transient failure: the next attempt runs it again with this derived key\n", "  outcome")
			} else {
				unknown = true
				fmt.Fprintf(w, "%-12s never recorded: the other service may or may not have acted\n", "  outcome")
			}
		default:
			fmt.Fprintf(w, "%-12s %s\n", "  result", st.Result)
		}
	}
	if unknown {
		fmt.Fprintln(w, "\nA step begun and never recorded is run again with its derived key by the next\nattempt (OnUnknown(StepRerun), the default), or refused (StepRefuse: the outcome\nis unknown). Ask the other service what it did with the derived key, then settle\nthe step: idem resolve --step NAME with --done JSON, --failed MESSAGE or --forget.")
	}
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

// inspectSummaryRows is how many records past their lease --summary lists.
const inspectSummaryRows = 10

// recordSummary is what `idem inspect --summary` reports about a store.
type recordSummary struct {
	Complete, InFlight, Expired int64
	PastLease                   int64       // in flight, lease lapsed, not expired
	OldestInFlight              time.Time   // zero when nothing is in flight
	Lapsed                      []lapsedKey // the first inspectSummaryRows past their lease, oldest lease first
}

type lapsedKey struct {
	Scope, Key string
	LeaseUntil time.Time
}

// recordSummarizer is what a store would implement to answer --summary
// itself. No store does yet; summarizeSQL answers for the SQL stores.
type recordSummarizer interface {
	Summary(ctx context.Context, now time.Time, limit int) (recordSummary, error)
}

func runInspectSummary(ctx context.Context, fs *flag.FlagSet, pos []string, opts dbopen.Options, stdout, stderr io.Writer) int {
	if len(pos) != 0 {
		return storeUsageError(stderr, fs, fmt.Sprintf("--summary takes no KEY (got %d arguments); drop --summary to inspect one key", len(pos)))
	}
	if opts.DB == "" {
		return storeUsageError(stderr, fs, "--db is required; for example --db sqlite:idem-demo.db or --db postgres://…")
	}
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
	var sum recordSummary
	if s, ok := h.Store.(recordSummarizer); ok {
		sum, err = s.Summary(ctx, now, inspectSummaryRows)
	} else if h.Redis != nil {
		fmt.Fprintf(stderr, "idem inspect: --summary counts the records of a SQL store; the keys are in Redis (%s), where they expire by themselves\n", h.KeysAt)
		return exitFailure
	} else {
		sum, err = summarizeSQL(ctx, h, now, inspectSummaryRows)
	}
	if err != nil {
		storeFailure(stderr, "idem inspect", err, h)
		return exitFailure
	}
	inspectPrintSummary(stdout, h.KeysAt, sum, now)
	return exitOK
}

// sqlRecords returns the quoted table of the SQL store in h, and how its
// dialect keeps times: t converts a time to it, back converts a scanned value
// into a time.
func sqlRecords(h *dbopen.Handle) (table string, t func(time.Time) any, back func(any) (time.Time, error), err error) {
	tabler, ok := h.Store.(interface{ Table() string })
	if !ok {
		return "", nil, nil, fmt.Errorf("the store %T does not name its table", h.Store)
	}
	switch h.Target.Dialect {
	case orders.SQLite:
		table = `"` + strings.ReplaceAll(tabler.Table(), `"`, `""`) + `"`
		t = func(x time.Time) any { return x.UnixNano() }
		back = func(v any) (time.Time, error) {
			n, ok := v.(int64)
			if !ok {
				return time.Time{}, fmt.Errorf("unexpected time %T", v)
			}
			return time.Unix(0, n), nil
		}
	case orders.MySQL:
		table = "`" + tabler.Table() + "`"
		t = func(x time.Time) any { return x.UnixMicro() }
		back = func(v any) (time.Time, error) {
			var n int64
			switch x := v.(type) {
			case int64:
				n = x
			case []byte:
				if _, err := fmt.Sscan(string(x), &n); err != nil {
					return time.Time{}, err
				}
			default:
				return time.Time{}, fmt.Errorf("unexpected time %T", v)
			}
			return time.UnixMicro(n), nil
		}
	case orders.Postgres:
		table = tabler.Table() // already quoted
		t = func(x time.Time) any { return x }
		back = func(v any) (time.Time, error) {
			x, ok := v.(time.Time)
			if !ok {
				return time.Time{}, fmt.Errorf("unexpected time %T", v)
			}
			return x, nil
		}
	default:
		return "", nil, nil, fmt.Errorf("idem inspect does not know the dialect of %s", h.Target.Display)
	}
	return table, t, back, nil
}

// inspectOtherScopes says, after a key was not found in scope, under which
// other scopes a live record with the key exists (the --scope was wrong or
// missing), so that the user does not conclude the key was never used. It
// searches the SQL stores' tables and Redis's keys; a failure of the search
// only omits the hint.
func inspectOtherScopes(ctx context.Context, w io.Writer, h *dbopen.Handle, scope, key string, now time.Time) {
	const most = 5
	scopes, more, err := scopesWithKey(ctx, h, key, now, most)
	if err != nil || len(scopes) == 0 {
		return
	}
	quoted := make([]string, len(scopes))
	for i, s := range scopes {
		quoted[i] = fmt.Sprintf("%q", s)
	}
	list := strings.Join(quoted, ", ")
	if more {
		list += ", …"
	}
	// A stored scope that is a digest (a scope too long or not printable, or a
	// message consumer's) cannot be typed back: --scope takes the original.
	plain := ""
	for _, s := range scopes {
		if !strings.HasPrefix(s, "sha256:") {
			plain = s
			break
		}
	}
	if plain != "" {
		fmt.Fprintf(w, "but the key has a record under scope %s (as stored): the scope is the tenant the service put the request under (idem demo: the bearer token); run again with --scope %s\n", list, shellQuote(plain))
	} else {
		fmt.Fprintf(w, "but the key has a record under scope %s (as stored): a digest of a scope longer than %d bytes or not printable (or a message consumer's); run again with --scope and the original value\n", list, idem.MaxStoredScopeLength)
	}
	if scope == "" {
		fmt.Fprintln(w, "(no --scope was given: the empty scope is only for services that do not scope their keys)")
	}
}

// shellQuote quotes s for a POSIX shell when it needs it.
func shellQuote(s string) string {
	if s != "" && strings.Trim(s, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/@") == "" {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// scopesWithKey returns the stored scopes (at most most of them, and whether
// there are more) under which key has a record that has not expired.
func scopesWithKey(ctx context.Context, h *dbopen.Handle, key string, now time.Time, most int) (scopes []string, more bool, err error) {
	if h.Redis != nil {
		return redisScopesWithKey(ctx, h, key, now, most)
	}
	table, t, _, err := sqlRecords(h)
	if err != nil {
		return nil, false, err
	}
	var q string
	var k any = []byte(key)
	switch h.Target.Dialect {
	case orders.Postgres:
		q = `SELECT scope FROM ` + table + ` WHERE key = $1 AND expires_at > $2 ORDER BY scope LIMIT ` + fmt.Sprint(most+1)
	case orders.MySQL:
		q = "SELECT scope FROM " + table + " WHERE `key` = ? AND expires_at > ? ORDER BY scope LIMIT " + fmt.Sprint(most+1)
	default:
		k = key // TEXT: a BLOB argument would never equal it
		q = `SELECT scope FROM ` + table + ` WHERE key = ? AND expires_at > ? ORDER BY scope LIMIT ` + fmt.Sprint(most+1)
	}
	add := func(s []byte) {
		if len(scopes) < most {
			scopes = append(scopes, string(s))
		} else {
			more = true
		}
	}
	if h.Pool != nil {
		rows, err := h.Pool.Query(ctx, q, k, t(now))
		if err != nil {
			return nil, false, err
		}
		defer rows.Close()
		for rows.Next() {
			var s []byte
			if err := rows.Scan(&s); err != nil {
				return nil, false, err
			}
			add(s)
		}
		return scopes, more, rows.Err()
	}
	rows, err := h.SQL.QueryContext(ctx, q, k, t(now))
	if err != nil {
		return nil, false, err
	}
	defer rows.Close()
	for rows.Next() {
		var s []byte
		if err := rows.Scan(&s); err != nil {
			return nil, false, err
		}
		add(s)
	}
	return scopes, more, rows.Err()
}

// redisScanLimit bounds the keys one hint looks at in Redis, so that a hint
// never walks a large keyspace.
const redisScanLimit = 100_000

// redisScopesWithKey finds the records of key under any scope in Redis by
// their names: PREFIX{base64url(scope).base64url(key)} (redisstore's layout).
func redisScopesWithKey(ctx context.Context, h *dbopen.Handle, key string, now time.Time, most int) (scopes []string, more bool, err error) {
	p, ok := h.Store.(interface{ Prefix() string })
	if !ok {
		return nil, false, fmt.Errorf("the store %T does not name its prefix", h.Store)
	}
	enc := base64.RawURLEncoding
	suffix := "." + enc.EncodeToString([]byte(key)) + "}"
	pattern := globEscape(p.Prefix()) + "{*" + suffix
	var cursor uint64
	seen := 0
	for {
		names, next, err := h.Redis.Scan(ctx, cursor, pattern, 1000).Result()
		if err != nil {
			return nil, false, err
		}
		for _, n := range names {
			inner := strings.TrimSuffix(strings.TrimPrefix(n, p.Prefix()+"{"), suffix)
			s, err := enc.DecodeString(inner)
			if err != nil {
				continue
			}
			// The name may outlive the record's expiry: ask the store.
			if _, err := h.Store.Get(ctx, string(s), key, now); err != nil {
				continue
			}
			if len(scopes) < most {
				scopes = append(scopes, string(s))
			} else {
				more = true
			}
		}
		seen += 1000
		if next == 0 || more || seen >= redisScanLimit {
			sort.Strings(scopes)
			return scopes, more, nil
		}
		cursor = next
	}
}

// globEscape escapes the characters Redis's MATCH patterns treat specially.
func globEscape(s string) string {
	return strings.NewReplacer(`\`, `\\`, "*", `\*`, "?", `\?`, "[", `\[`, "]", `\]`).Replace(s)
}

// summarizeSQL counts the records of the SQL store in h with plain queries on
// its table (the schema each store documents).
func summarizeSQL(ctx context.Context, h *dbopen.Handle, now time.Time, limit int) (recordSummary, error) {
	var sum recordSummary
	table, t, back, err := sqlRecords(h)
	if err != nil {
		return sum, err
	}
	ph := func(n int) string { // the n-th placeholder
		if h.Target.Dialect == orders.Postgres {
			return fmt.Sprintf("$%d", n)
		}
		return "?"
	}
	counts := `SELECT
		COALESCE(SUM(CASE WHEN expires_at > ` + ph(1) + ` AND state = 2 THEN 1 ELSE 0 END), 0),
		COALESCE(SUM(CASE WHEN expires_at > ` + ph(2) + ` AND state = 1 THEN 1 ELSE 0 END), 0),
		COALESCE(SUM(CASE WHEN expires_at <= ` + ph(3) + ` THEN 1 ELSE 0 END), 0),
		COALESCE(SUM(CASE WHEN expires_at > ` + ph(4) + ` AND state = 1 AND lease_until <= ` + ph(5) + ` THEN 1 ELSE 0 END), 0)
		FROM ` + table
	oldest := `SELECT MIN(created_at) FROM ` + table + ` WHERE state = 1 AND expires_at > ` + ph(1)
	lapsed := `SELECT scope, ` + map[bool]string{true: "`key`", false: "key"}[h.Target.Dialect == orders.MySQL] + `, lease_until FROM ` + table +
		` WHERE state = 1 AND expires_at > ` + ph(1) + ` AND lease_until <= ` + ph(2) + ` ORDER BY lease_until LIMIT ` + fmt.Sprint(limit)
	n := t(now)
	if h.Pool != nil {
		if err := h.Pool.QueryRow(ctx, counts, n, n, n, n, n).Scan(&sum.Complete, &sum.InFlight, &sum.Expired, &sum.PastLease); err != nil {
			return sum, fmt.Errorf("count the records of %s: %w", table, err)
		}
		var old *time.Time
		if err := h.Pool.QueryRow(ctx, oldest, n).Scan(&old); err != nil {
			return sum, fmt.Errorf("find the oldest in-flight record: %w", err)
		}
		if old != nil {
			sum.OldestInFlight = *old
		}
		rows, err := h.Pool.Query(ctx, lapsed, n, n)
		if err != nil {
			return sum, fmt.Errorf("list the records past their lease: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
			var scope, key []byte
			var lease time.Time
			if err := rows.Scan(&scope, &key, &lease); err != nil {
				return sum, err
			}
			sum.Lapsed = append(sum.Lapsed, lapsedKey{string(scope), string(key), lease})
		}
		return sum, rows.Err()
	}
	db := h.SQL
	if err := db.QueryRowContext(ctx, counts, n, n, n, n, n).Scan(&sum.Complete, &sum.InFlight, &sum.Expired, &sum.PastLease); err != nil {
		return sum, fmt.Errorf("count the records of %s: %w", table, err)
	}
	var old any
	if err := db.QueryRowContext(ctx, oldest, n).Scan(&old); err != nil {
		return sum, fmt.Errorf("find the oldest in-flight record: %w", err)
	}
	if old != nil {
		x, err := back(old)
		if err != nil {
			return sum, err
		}
		sum.OldestInFlight = x
	}
	rows, err := db.QueryContext(ctx, lapsed, n, n)
	if err != nil {
		return sum, fmt.Errorf("list the records past their lease: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var scope, key []byte
		var lease any
		if err := rows.Scan(&scope, &key, &lease); err != nil {
			return sum, err
		}
		x, err := back(lease)
		if err != nil {
			return sum, err
		}
		sum.Lapsed = append(sum.Lapsed, lapsedKey{string(scope), string(key), x})
	}
	return sum, rows.Err()
}

// inspectPrintSummary writes sum for a human.
func inspectPrintSummary(w io.Writer, where string, sum recordSummary, now time.Time) {
	ago := func(x time.Time) string { return now.Sub(x).Round(time.Millisecond).String() }
	fmt.Fprintf(w, "records in %s at %s:\n", where, now.UTC().Format(time.RFC3339))
	fmt.Fprintf(w, "%-18s %d\n", "complete:", sum.Complete)
	fmt.Fprintf(w, "%-18s %d\n", "in flight:", sum.InFlight)
	fmt.Fprintf(w, "%-18s %d (their holders crashed or stalled: the next retry of each takes it over, or gets 503 idempotency_outcome_unknown under LapsedRefuse until idem resolve)\n", "past their lease:", sum.PastLease)
	fmt.Fprintf(w, "%-18s %d (they count as absent; `idem gc` or the janitor deletes them)\n", "expired:", sum.Expired)
	if sum.OldestInFlight.IsZero() {
		fmt.Fprintf(w, "%-18s none\n", "oldest in flight:")
	} else {
		fmt.Fprintf(w, "%-18s created %s ago (%s)\n", "oldest in flight:", ago(sum.OldestInFlight), sum.OldestInFlight.UTC().Format(time.RFC3339Nano))
	}
	if len(sum.Lapsed) > 0 {
		fmt.Fprintf(w, "\npast their lease (oldest first, at most %d):\n", inspectSummaryRows)
		for _, l := range sum.Lapsed {
			fmt.Fprintf(w, "  scope %q key %q: lease lapsed %s ago\n", l.Scope, l.Key, ago(l.LeaseUntil))
		}
	}
}
