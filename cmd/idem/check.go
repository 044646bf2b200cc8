package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"

	"github.com/idemkit/idem/internal/checker"
)

func init() {
	register(&command{
		name:    "check",
		summary: "check any HTTP API's Idempotency-Key handling: replays, mismatches, a concurrent race",
		run:     runCheck,
	})
}

const checkUsage = `Usage: idem check URL [flags]

Sends crafted requests to one endpoint of any HTTP API, in any language, and
reports case by case whether it handles the Idempotency-Key header as the IETF
draft and idem's contract say: an identical retry is replayed byte for byte, a
changed body with a used key gets 422, a missing or over-long key gets 400, a
new key makes a new resource, a client that hangs up mid-request and retries
gets the replay of the one execution, and N identical requests released at the
same instant execute once (the others get 409 or the replay). With
--tenant-b-header it also checks that tenants do not share keys.

The body is a template: {{marker}} becomes a marker unique to each case of a
run, {{n}} a number unique to each operation. With --count-url the checker
counts on the server what a case created (a race must leave exactly 1).

A replay is an answer with "Idempotent-Replayed: true" (Stripe's convention,
what clients look for). The other spellings servers use set to "true"
(Idempotency-Replayed, X-Idempotent-Replayed, X-Idempotency-Replayed, …) count
as a replay mark too, with a warning that clients look for Idempotent-Replayed.

Example:
  idem check http://127.0.0.1:8080/orders \
    --header 'Authorization: Bearer tenant-a' \
    --tenant-b-header 'Authorization: Bearer tenant-b' \
    --count-url 'http://127.0.0.1:8080/orders?cart_id={{marker}}'

Cases: %s.
Exit codes: 0 nothing failed (warnings allowed), 1 a case failed, 2 bad usage.

Flags:
`

// checkHeaderFlag collects repeated "Name: value" flags.
type checkHeaderFlag struct{ h http.Header }

// String returns the headers as "Name: value" pairs.
func (f *checkHeaderFlag) String() string {
	if f == nil || len(f.h) == 0 {
		return ""
	}
	var parts []string
	for k, vs := range f.h {
		for _, v := range vs {
			parts = append(parts, k+": "+v)
		}
	}
	return strings.Join(parts, ", ")
}

// Get returns the headers collected so far.
func (f *checkHeaderFlag) Get() any { return f.h }

// Set adds one "Name: value" header.
func (f *checkHeaderFlag) Set(s string) error {
	name, value, ok := strings.Cut(s, ":")
	name = strings.TrimSpace(name)
	if !ok || name == "" || strings.ContainsAny(name, " \t") {
		return fmt.Errorf("%q is not a header; write \"Name: value\"", s)
	}
	if f.h == nil {
		f.h = http.Header{}
	}
	f.h.Add(name, strings.TrimSpace(value))
	return nil
}

func runCheck(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem check", flag.ContinueOnError)
	fs.SetOutput(io.Discard) // errors and usage are printed below
	var (
		opts            checker.Options
		header, tenantB checkHeaderFlag
		only            string
		asJSON          bool
		progress        bool
		requireKey      bool
	)
	fs.StringVar(&opts.Method, "method", checker.DefaultMethod, "request `method` of the endpoint")
	fs.StringVar(&opts.Body, "body", checker.DefaultBody, "request body `template`; {{marker}} and {{n}} are replaced")
	fs.Var(&header, "header", "a `\"Name: value\"` header sent with every request, e.g. authentication (repeatable)")
	fs.Var(&tenantB, "tenant-b-header", "a `\"Name: value\"` header of a second tenant, replacing --header of that name; enables tenant_isolation (repeatable)")
	fs.StringVar(&opts.KeyHeader, "key-header", checker.DefaultKeyHeader, "`name` of the request header carrying the key")
	fs.DurationVar(&opts.Timeout, "timeout", checker.DefaultTimeout, "per-request `timeout`")
	fs.IntVar(&opts.Concurrency, "concurrency", checker.DefaultConcurrency, "`number` of identical requests the race releases at once")
	fs.IntVar(&opts.Rounds, "rounds", 1, "`number` of race rounds, each with a fresh key")
	fs.DurationVar(&opts.HangupAfter, "hangup-after", 0, "hang up this `long` after sending a request, then retry it (hangup case); default: half the time an execution took, when that was at least "+checker.HangupMinWait.String())
	fs.StringVar(&opts.CountURL, "count-url", "", "GET `URL` template listing the resources of {{marker}}, e.g. http://h/orders?cart_id={{marker}}")
	fs.StringVar(&opts.CountPath, "count-path", "", "dotted `path` to the array or number in the count URL's JSON (default: the first array)")
	fs.BoolVar(&requireKey, "require-key", true, "the endpoint requires a key: a request without one must get 400")
	fs.StringVar(&only, "only", "", "comma-separated `cases` to run (default all)")
	fs.BoolVar(&asJSON, "json", false, "write the report as JSON")
	fs.BoolVar(&progress, "progress", false, "show race progress on stderr even when it is not a terminal")

	fs.Usage = storeUsage(fs, fmt.Sprintf(checkUsage, strings.Join(checker.CaseNames(), ", ")), nil)
	urls, code, ok := parseFlags(fs, args, nil, stdout, stderr)
	if !ok {
		return code
	}
	if msg := checkFlagProblem(urls, opts); msg != "" {
		return storeUsageError(stderr, fs, msg)
	}
	opts.URL = urls[0]
	opts.Header = header.h
	opts.TenantBHeader = tenantB.h
	opts.KeyOptional = !requireKey
	if only != "" {
		for _, name := range strings.Split(only, ",") {
			opts.Only = append(opts.Only, strings.TrimSpace(name))
		}
	}
	if progress || checkIsTerminal(stderr) {
		opts.Progress = stderr
	}

	rep, err := checker.Run(ctx, opts)
	if errors.Is(err, checker.ErrInvalidOptions) {
		fmt.Fprintf(stderr, "idem check: %v\nRun `idem check --help` for the flags and an example.\n", err)
		return exitUsage
	}
	if rep != nil {
		if asJSON {
			err = errors.Join(err, rep.WriteJSON(stdout))
		} else {
			err = errors.Join(err, rep.WriteTable(stdout))
		}
	}
	if err != nil {
		fmt.Fprintf(stderr, "idem check: %v\n", err)
		return exitFailure
	}
	if rep.Failed() {
		return exitFailure
	}
	return exitOK
}

// checkFlagProblem says what is wrong with the positional arguments and the
// flag values, or returns "". The checker takes a zero as "the default": here a
// zero the user gave is an error, not a silent 50.
func checkFlagProblem(urls []string, opts checker.Options) string {
	if len(urls) != 1 {
		return fmt.Sprintf("want exactly one URL, got %d; for example idem check http://127.0.0.1:8080/orders", len(urls))
	}
	switch {
	case opts.Concurrency < 2 || opts.Concurrency > checker.MaxConcurrency:
		return fmt.Sprintf("--concurrency %d: a race needs at least 2 identical requests and at most %d; the default is %d", opts.Concurrency, checker.MaxConcurrency, checker.DefaultConcurrency)
	case opts.Rounds < 1:
		return fmt.Sprintf("--rounds %d: run at least 1 round of the race", opts.Rounds)
	case opts.Timeout <= 0:
		return fmt.Sprintf("--timeout %v: give a positive per-request timeout such as %v", opts.Timeout, checker.DefaultTimeout)
	case opts.HangupAfter < 0:
		return fmt.Sprintf("--hangup-after %v is negative; give a duration such as 200ms, or leave it out to derive it", opts.HangupAfter)
	case strings.TrimSpace(opts.Method) == "":
		return fmt.Sprintf("--method is empty; give the endpoint's method, such as %s", checker.DefaultMethod)
	case strings.TrimSpace(opts.KeyHeader) == "":
		return fmt.Sprintf("--key-header is empty; give the header's name, such as %s", checker.DefaultKeyHeader)
	case opts.Body == "":
		return "--body is empty; give the request body template, with {{marker}} where the checker may put a unique marker, or leave it out for the default"
	}
	return ""
}

// checkIsTerminal reports whether w is a character device such as a terminal.
func checkIsTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
