package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/proxy"
)

func init() {
	register(&command{
		name:    "resolve",
		summary: "settle a key whose outcome is unknown: store the answer it gets, or release it",
		run:     runResolve,
	})
}

const resolveUsage = `Usage: idem resolve --db URL --scope TENANT KEY (--status N [--body TEXT] | --release)
       idem resolve --db URL --scope TENANT --step NAME KEY (--done JSON | --failed MESSAGE | --forget)

Settles a key left in flight by a request whose outcome is unknown (its
upstream or server died mid-request; idem proxy answers retries with 503
idempotency_outcome_unknown until then). Find out first, at the upstream,
whether the operation took effect. Then:

  --status N [--body …]   it did: every request with the key gets this answer,
                          replayed, and the operation does not run again
  --release               it did not: the next request with the key runs it

A key held by a request that is running now (its lease is live) is left alone
unless --force.

With --step NAME it settles one step of the key's operation instead (see
idem.Step and docs/effects.md): a step begun by an attempt that died before
recording it, which a handler with OnUnknown(StepRefuse) refuses to run again.
Find out at the other service (by the step's derived key, shown by idem
inspect) whether it acted. Then:

  --done JSON        it did: JSON is the step's result, as the handler's step
                     function returns it encoded (idem demo's charge step:
                     {"id":"ch_…"}); the next attempt carries on from it
  --failed MESSAGE   it failed for good: the next attempt gets the failure
  --forget           it did not act: the record is deleted, and the next
                     attempt runs the step afresh with a NEW derived key

The key's own record is not changed: a retry after its lease lapsed (at once
in the single-transaction flow) runs the handler, which finds the settled step.

Example:
  idem resolve --db sqlite:keys.db --scope acme --status 201 \
    --header 'Content-Type: application/json' --body '{"id":"ord_42"}' 8e03978e-40d5-43e8
  idem resolve --db sqlite:keys.db --scope acme --release 8e03978e-40d5-43e8
  idem resolve --db postgres://postgres@127.0.0.1:5432/app --schema shop \
    --scope t1 --release 8e03978e-40d5-43e8
  idem resolve --db sqlite:idem-demo.db --scope t1 --step charge \
    --done '{"id":"ch_5f2a"}' 8e03978e-40d5-43e8

Exit codes: 0 resolved, 1 nothing to resolve (no record, already complete, held
now) or the database failed, 2 bad usage.

Flags:
`

func runResolve(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem resolve", flag.ContinueOnError)
	db, keys, table := storeFlags(fs, "")
	prefix, schema := storeNameFlags(fs)
	scope := fs.String("scope", "", "the tenant the key belongs to (idem proxy --scope-header: the header's value; --scope-jwt-claim: the claim's)")
	bearer := fs.String("bearer", "", "with idem proxy --scope-bearer: the client's bearer token, instead of --scope")
	status := fs.Int("status", 0, "mark the key complete with this status")
	body := fs.String("body", "", "the answer's body, with --status")
	bodyFile := fs.String("body-file", "", "read the answer's body from this file, with --status")
	var headers multiFlag
	fs.Var(&headers, "header", "an answer header 'Name: value', with --status; repeatable")
	release := fs.Bool("release", false, "release the key: the next request with it runs the operation")
	ttl := fs.Duration("ttl", idem.DefaultTTL, "with --status: how long the answer is kept and replayed")
	force := fs.Bool("force", false, "also settle a key whose lease is live (its holder is running now, or hung)")
	step := fs.String("step", "", "settle the step called `NAME` of the key's operation instead of the key (with --done, --failed or --forget)")
	stepDone := fs.String("done", "", "with --step: the step took effect; its result, as `JSON`")
	stepFailed := fs.String("failed", "", "with --step: the step failed for good; the failure's `message`")
	stepForget := fs.Bool("forget", false, "with --step: the step did not act; delete its record, so the next attempt runs it with a new derived key")
	fs.Usage = storeUsage(fs, resolveUsage, storeNameEnv)
	pos, code, ok := storeParse(fs, args, storeNameEnv, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) != 1 {
		return storeUsageError(stderr, fs, fmt.Sprintf("give exactly one KEY (got %d arguments)", len(pos)))
	}
	if *db == "" {
		return storeUsageError(stderr, fs, "--db is required; the database idem proxy keeps its keys in, for example --db sqlite:keys.db")
	}
	if *step != "" || *stepDone != "" || *stepFailed != "" || *stepForget {
		return resolveStep(ctx, fs, stepSettle{
			db: *db, keys: *keys, table: *table, prefix: *prefix, schema: *schema, scope: *scope, bearer: *bearer,
			key: pos[0], name: *step, done: *stepDone, failed: *stepFailed, forget: *stepForget, force: *force,
			keyFlags: *status != 0 || *release || *body != "" || *bodyFile != "" || len(headers) > 0,
		}, stdout, stderr)
	}
	if (*status != 0) == *release {
		return storeUsageError(stderr, fs, "give one of --status N (the operation took effect) and --release (it did not)")
	}
	if *status != 0 && (*status < 200 || *status > 599) {
		return storeUsageError(stderr, fs, fmt.Sprintf("--status %d: use an HTTP status from 200 to 599", *status))
	}
	if *ttl <= 0 {
		// A complete record that expires at once is no record: the next request
		// with the key would run the operation again.
		return storeUsageError(stderr, fs, fmt.Sprintf("--ttl %v: use a positive duration; the answer is replayed for that long", *ttl))
	}
	if *release && (*body != "" || *bodyFile != "" || len(headers) > 0) {
		return storeUsageError(stderr, fs, "--body, --body-file and --header go with --status, not --release")
	}
	if *body != "" && *bodyFile != "" {
		return storeUsageError(stderr, fs, "give --body or --body-file, not both")
	}
	if *bearer != "" {
		if *scope != "" {
			return storeUsageError(stderr, fs, "give --scope or --bearer, not both")
		}
		*scope = proxy.BearerScopeOf(*bearer)
	}
	key, err := idem.ParseKey(pos[0], idem.DefaultMaxKeyLength)
	if err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	resp := &idem.Response{Status: *status, Body: []byte(*body)}
	if *bodyFile != "" {
		if resp.Body, err = os.ReadFile(*bodyFile); err != nil {
			return storeUsageError(stderr, fs, "--body-file: "+err.Error())
		}
	}
	for _, hv := range headers {
		name, value, ok := strings.Cut(hv, ":")
		if !ok || strings.TrimSpace(name) == "" {
			return storeUsageError(stderr, fs, fmt.Sprintf("--header %q: write it as 'Name: value'", hv))
		}
		if resp.Header == nil {
			resp.Header = http.Header{}
		}
		resp.Header.Add(strings.TrimSpace(name), strings.TrimSpace(value))
	}
	opts := dbopen.Options{DB: *db, Keys: *keys, KeyTable: *table, Prefix: *prefix, Schema: *schema}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	h, err := dbopen.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "idem resolve: %v\n", err)
		return exitFailure
	}
	defer h.Close()
	stored := idem.StoredScope(*scope)
	// A refused retry may take the record over for a moment (a new token; only
	// when the lease lapsed between its read and its claim), and a stalled holder
	// may still finish: read it again and retry when the token moved under us.
	for attempt := 0; ; attempt++ {
		now := time.Now()
		rec, err := h.Store.Get(ctx, stored, key, now)
		switch {
		case errors.Is(err, idem.ErrNotFound):
			fmt.Fprintf(stdout, "no record for key %q in scope %q (%s): nothing to resolve; the next request with it runs afresh\n", key, *scope, h.KeysAt)
			return exitFailure
		case err != nil:
			fmt.Fprintf(stderr, "idem resolve: %v\n", err)
			return exitFailure
		case rec.State == idem.StateComplete:
			fmt.Fprintf(stdout, "key %q in scope %q is already complete (status %d): nothing to resolve\n", key, *scope, rec.Response.Status)
			return exitFailure
		case rec.LeaseUntil.After(now) && !*force:
			fmt.Fprintf(stdout, "key %q in scope %q is held by a request running now (lease until %s); wait for it, or give --force if its holder is gone\n", key, *scope, rec.LeaseUntil.Format(time.RFC3339))
			return exitFailure
		}
		if *release {
			err = h.Store.Release(ctx, stored, key, rec.Token)
		} else {
			err = h.Store.Complete(ctx, stored, key, rec.Token, resp, now, now.Add(*ttl))
		}
		if errors.Is(err, idem.ErrLockLost) && attempt < 10 {
			time.Sleep(20 * time.Millisecond)
			continue
		}
		if err != nil {
			fmt.Fprintf(stderr, "idem resolve: %v\n", err)
			return exitFailure
		}
		if *release {
			fmt.Fprintf(stdout, "released key %q in scope %q: the next request with it runs the operation\n", key, *scope)
		} else {
			fmt.Fprintf(stdout, "resolved key %q in scope %q: every request with it now gets %d (%d bytes), replayed\n", key, *scope, resp.Status, len(resp.Body))
		}
		return exitOK
	}
}

// stepSettle is what idem resolve --step was asked.
type stepSettle struct {
	db, keys, table, prefix, schema string
	scope, bearer, key, name        string
	done, failed                    string
	forget, force, keyFlags         bool
}

// resolveStep settles one step record of a key's operation (idem resolve
// --step NAME).
func resolveStep(ctx context.Context, fs *flag.FlagSet, a stepSettle, stdout, stderr io.Writer) int {
	if a.name == "" {
		return storeUsageError(stderr, fs, "--done, --failed and --forget settle a step: name it with --step NAME")
	}
	if a.keyFlags {
		return storeUsageError(stderr, fs, "--step settles a step, not the key: give --done, --failed or --forget, not --status, --body, --header or --release")
	}
	n := 0
	for _, set := range []bool{a.done != "", a.failed != "", a.forget} {
		if set {
			n++
		}
	}
	if n != 1 {
		return storeUsageError(stderr, fs, "with --step give exactly one of --done JSON (it took effect), --failed MESSAGE (it failed for good) and --forget (it did not act)")
	}
	if len(a.name) > idem.MaxStepNameLength {
		return storeUsageError(stderr, fs, fmt.Sprintf("--step: a step name is at most %d bytes", idem.MaxStepNameLength))
	}
	state, result := idem.StepState(0), []byte(nil)
	switch {
	case a.done != "":
		if !json.Valid([]byte(a.done)) {
			return storeUsageError(stderr, fs, fmt.Sprintf("--done %q is not JSON; give the step's result as its step function encodes it, for example '{\"id\":\"ch_5f2a\"}'", a.done))
		}
		state, result = idem.StepDone, []byte(a.done)
	case a.failed != "":
		state = idem.StepFailed
		result, _ = json.Marshal(struct {
			Message string `json:"message"`
		}{a.failed})
	}
	if a.bearer != "" {
		if a.scope != "" {
			return storeUsageError(stderr, fs, "give --scope or --bearer, not both")
		}
		a.scope = proxy.BearerScopeOf(a.bearer)
	}
	key, err := idem.ParseKey(a.key, idem.DefaultMaxKeyLength)
	if err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	opts := dbopen.Options{DB: a.db, Keys: a.keys, KeyTable: a.table, Prefix: a.prefix, Schema: a.schema}
	if err := opts.Check(); err != nil {
		return storeUsageError(stderr, fs, err.Error())
	}
	h, err := dbopen.Open(ctx, opts)
	if err != nil {
		fmt.Fprintf(stderr, "idem resolve: %v\n", err)
		return exitFailure
	}
	defer h.Close()
	ss, ok := h.Store.(idem.StepStore)
	if !ok {
		fmt.Fprintf(stderr, "idem resolve: the store at %s keeps no step records\n", h.KeysAt)
		return exitFailure
	}
	stored, now := idem.StoredScope(a.scope), time.Now()
	steps, err := ss.GetSteps(ctx, stored, key, now)
	if err != nil {
		fmt.Fprintf(stderr, "idem resolve: %v\n", err)
		return exitFailure
	}
	var rec *idem.StepRecord
	for i := range steps {
		if steps[i].Name == a.name {
			rec = &steps[i]
		}
	}
	if rec == nil {
		fmt.Fprintf(stdout, "no step %q for key %q in scope %q (%s): nothing to settle\n", a.name, key, a.scope, h.KeysAt)
		return exitFailure
	}
	if rec.State == idem.StepStarted && !a.force {
		// An attempt running now may be in the middle of the step.
		if r, err := h.Store.Get(ctx, stored, key, now); err == nil && r.State == idem.StateInFlight && r.LeaseUntil.After(now) {
			fmt.Fprintf(stdout, "key %q in scope %q is held by a request running now (lease until %s), which may be running step %q; wait for its lease to lapse, or give --force if its holder is gone\n", key, a.scope, r.LeaseUntil.Format(time.RFC3339), a.name)
			return exitFailure
		}
	}
	if err := ss.SettleStep(ctx, stored, key, a.name, state, result, now); err != nil {
		if errors.Is(err, idem.ErrNotFound) {
			fmt.Fprintf(stdout, "no step %q for key %q in scope %q (%s): nothing to settle\n", a.name, key, a.scope, h.KeysAt)
			return exitFailure
		}
		fmt.Fprintf(stderr, "idem resolve: %v\n", err)
		return exitFailure
	}
	switch {
	case a.forget:
		fmt.Fprintf(stdout, "forgot step %q of key %q in scope %q (it was %s, derived key %s): the next attempt runs it afresh with a new derived key\n", a.name, key, a.scope, rec.State, rec.DerivedKey)
	case a.done != "":
		fmt.Fprintf(stdout, "settled step %q of key %q in scope %q as done (it was %s): the next attempt carries on with its result %s, without running it\n", a.name, key, a.scope, rec.State, a.done)
	default:
		fmt.Fprintf(stdout, "settled step %q of key %q in scope %q as failed (it was %s): the next attempt gets the failure %q, without running it\n", a.name, key, a.scope, rec.State, a.failed)
	}
	return exitOK
}
