package checker_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/checker"
	"github.com/idemkit/idem/internal/checker/checkertest"
)

// options returns options for a checkertest server: tenant A and B, and a
// count URL when count is true.
func options(srv *httptest.Server, count bool) checker.Options {
	o := checker.Options{
		URL:           srv.URL + "/orders",
		Header:        http.Header{"Authorization": {"Bearer tenant-a"}},
		TenantBHeader: http.Header{"Authorization": {"Bearer tenant-b"}},
		Timeout:       30 * time.Second,
	}
	if count {
		o.CountURL = srv.URL + "/orders?cart_id={{marker}}"
	}
	return o
}

func run(t *testing.T, o checker.Options) *checker.Report {
	t.Helper()
	rep, err := checker.Run(t.Context(), o)
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	return rep
}

func table(rep *checker.Report) string {
	var b strings.Builder
	_ = rep.WriteTable(&b)
	return b.String()
}

// names returns the names of the cases with result res.
func names(rep *checker.Report, res checker.Result) []string {
	var out []string
	for _, c := range rep.Cases {
		if c.Result == res {
			out = append(out, c.Name)
		}
	}
	return out
}

func TestCorrectServerPassesEveryCase(t *testing.T) {
	t.Parallel()
	for _, count := range []bool{false, true} {
		t.Run(map[bool]string{false: "answers", true: "count"}[count], func(t *testing.T) {
			t.Parallel()
			srv := checkertest.NewServer(checkertest.Correct)
			defer srv.Close()
			rep := run(t, options(srv, count))
			if got := len(rep.Cases); got != len(checker.CaseNames()) {
				t.Errorf("%d cases ran, want %d", got, len(checker.CaseNames()))
			}
			for _, c := range rep.Cases {
				// On a loaded machine the 20ms order may end before the hang-up
				// (a skip); TestHangup checks that case on its own.
				if c.Result != checker.Pass && (c.Name != checker.CaseHangup || c.Result != checker.Skip) {
					t.Errorf("case %s: %s (%s), want pass", c.Name, c.Result, c.Summary)
				}
			}
			if rep.Failed() {
				t.Error("Failed() = true")
			}
			if t.Failed() {
				t.Log("\n" + table(rep))
			}
		})
	}
}

// TestWaitingServerPassesEveryCase: a server whose duplicates wait for the
// running request's outcome (idem.Config.InFlightWait) answers the race with
// one execution and replays, no 409: every case passes.
func TestWaitingServerPassesEveryCase(t *testing.T) {
	t.Parallel()
	srv := checkertest.NewWaitingServer()
	defer srv.Close()
	rep := run(t, options(srv, true))
	for _, c := range rep.Cases {
		if c.Result != checker.Pass && (c.Name != checker.CaseHangup || c.Result != checker.Skip) {
			t.Errorf("case %s: %s (%s), want pass", c.Name, c.Result, c.Summary)
		}
	}
	if c := rep.Case(checker.CaseRace); c == nil || strings.Contains(c.Summary, "409×") {
		t.Errorf("race against a waiting server: %+v, want no 409", c)
	}
	if t.Failed() {
		t.Log("\n" + table(rep))
	}
}

// TestCorrectServerRaceIsNotFlaky runs the race 20 times against the correct
// server: a checker that sometimes fails a correct server is useless.
func TestCorrectServerRaceIsNotFlaky(t *testing.T) {
	t.Parallel()
	srv := checkertest.NewServer(checkertest.Correct)
	defer srv.Close()
	o := options(srv, true)
	o.Only = []string{checker.CaseRace}
	o.Rounds = 20
	rep := run(t, o)
	c := rep.Case(checker.CaseRace)
	if c == nil || c.Result != checker.Pass {
		t.Fatalf("race over 20 rounds did not pass:\n%s", table(rep))
	}
	// 20 rounds, each with exactly one execution, and requests that really
	// overlapped with it (409).
	if !strings.Contains(c.Summary, "201×20,") || !strings.Contains(c.Summary, "409×") {
		t.Errorf("summary %q does not show exactly 20 executions (201×20) and some 409s", c.Summary)
	}
}

// TestFlawedServersFailTheRightCase points the checker at services with one
// deliberate flaw each: the case that names the flaw must fail, and no case
// without a reason to.
func TestFlawedServersFailTheRightCase(t *testing.T) {
	t.Parallel()
	tests := []struct {
		flaw checkertest.Flaw
		must []string // cases that must fail
		may  []string // cases that may fail as a consequence (timing, counts)
		// mayCounted are further cases that may fail when resources are counted.
		mayCounted []string
		// maySkip are cases that may be skipped: hangup when a second request
		// with the key, sent while the first runs, is not answered 409.
		maySkip []string
	}{
		// The retry after a hang-up lands in the gap between check and write.
		{flaw: checkertest.CheckThenWrite, must: []string{checker.CaseRace}, may: []string{checker.CaseHangup}, maySkip: []string{checker.CaseHangup}},
		{flaw: checkertest.NoFingerprint, must: []string{checker.CaseChangedBody}},
		{
			flaw: checkertest.NoIdempotency,
			must: []string{checker.CaseReplay, checker.CaseChangedBody, checker.CaseRace},
			// The replay executed again, so the first marker counts 3, not 2;
			// the retry after the hang-up executed again too.
			mayCounted: []string{checker.CaseNewKey, checker.CaseHangup},
			maySkip:    []string{checker.CaseHangup},
		},
		{flaw: checkertest.TruncatedKeys, must: []string{checker.CaseLongKey}},
		{flaw: checkertest.HangupRollsBack, must: []string{checker.CaseHangup}},
		// Replays inside the race differ too when the winner completes before
		// others arrive.
		{flaw: checkertest.RerenderedReplay, must: []string{checker.CaseReplay}, may: []string{checker.CaseRace}},
		{flaw: checkertest.SharedKeys, must: []string{checker.CaseTenantIsolation}},
	}
	for _, tt := range tests {
		for _, count := range []bool{false, true} {
			name := tt.flaw.String() + map[bool]string{false: "/answers", true: "/count"}[count]
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				srv := checkertest.NewServer(tt.flaw)
				defer srv.Close()
				rep := run(t, options(srv, count))
				failed := names(rep, checker.Fail)
				for _, want := range tt.must {
					if !slices.Contains(failed, want) {
						t.Errorf("case %s did not fail", want)
					}
				}
				for _, got := range failed {
					ok := slices.Contains(tt.must, got) || slices.Contains(tt.may, got) || (count && slices.Contains(tt.mayCounted, got))
					if !ok {
						t.Errorf("case %s failed, but the flaw is not there", got)
					}
				}
				if !rep.Failed() {
					t.Error("Failed() = false")
				}
				for _, s := range names(rep, checker.Skip) {
					// On a loaded machine the 20ms order may end before the
					// hang-up; TestHangup checks that case on its own.
					if !slices.Contains(tt.maySkip, s) && s != checker.CaseHangup {
						t.Errorf("case %s skipped", s)
					}
				}
				if t.Failed() {
					t.Log("\n" + table(rep))
				}
			})
		}
	}
}

// TestRaceEvidence checks that a failed race says what it saw.
func TestRaceEvidence(t *testing.T) {
	t.Parallel()
	srv := checkertest.NewServer(checkertest.CheckThenWrite)
	defer srv.Close()
	o := options(srv, true)
	o.Only = []string{checker.CaseRace}
	o.Concurrency = 10
	rep := run(t, o)
	c := rep.Case(checker.CaseRace)
	if c == nil || c.Result != checker.Fail {
		t.Fatalf("race did not fail:\n%s", table(rep))
	}
	ev := strings.Join(append([]string{c.Summary}, c.Evidence...), "\n")
	for _, want := range []string{"201×10", "the count URL lists 10 resources", "different bodies", "bodies differ at byte"} {
		if !strings.Contains(ev, want) {
			t.Errorf("evidence lacks %q:\n%s", want, ev)
		}
	}
}

// TestRaceSendsEachRequestOnce counts arrivals at a server that drops every
// connection without answering: each request must arrive once, none re-sent.
func TestRaceSendsEachRequestOnce(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	arrivals := map[string]int{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		arrivals[r.Header.Get("Idempotency-Key")]++
		mu.Unlock()
		conn, _, err := http.NewResponseController(w).Hijack()
		if err == nil {
			_ = conn.Close()
		}
	}))
	defer srv.Close()
	const n = 20
	rep := run(t, checker.Options{URL: srv.URL, Only: []string{checker.CaseRace}, Concurrency: n})
	c := rep.Case(checker.CaseRace)
	if c.Result != checker.Fail || !strings.Contains(c.Summary, "got no answer") {
		t.Errorf("race = %s %q, want a failure for requests without answers", c.Result, c.Summary)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(arrivals) != 1 {
		t.Fatalf("%d keys arrived, want 1: %v", len(arrivals), arrivals)
	}
	for k, got := range arrivals {
		if got != n {
			t.Errorf("key %s arrived %d times, want %d", k, got, n)
		}
	}
}

func TestUnreachableServerFails(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close() // nothing listens there now
	rep := run(t, checker.Options{URL: "http://" + addr + "/orders", Concurrency: 2, Timeout: 5 * time.Second})
	if !rep.Failed() {
		t.Fatalf("an unreachable server did not fail:\n%s", table(rep))
	}
	if c := rep.Case(checker.CaseFirstRequest); c.Result != checker.Fail {
		t.Errorf("first_request = %s, want fail", c.Result)
	}
	for _, name := range []string{checker.CaseReplay, checker.CaseChangedBody, checker.CaseNewKey} {
		if c := rep.Case(name); c.Result != checker.Skip {
			t.Errorf("%s = %s, want skip", name, c.Result)
		}
	}
}

// TestWarnings checks the deviations that are warnings, not failures: 400
// instead of 422, 409 without Retry-After, no Idempotent-Replayed, non-problem
// errors, and a 256-character key accepted.
func TestWarnings(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	type rec struct {
		body, answer string
		done         bool
	}
	recs := map[string]*rec{}
	next := 0
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if key == "" {
			http.Error(w, "no key", http.StatusBadRequest) // text/plain
			return
		}
		var buf bytes.Buffer
		_, _ = buf.ReadFrom(r.Body)
		mu.Lock()
		rc, found := recs[key]
		if !found {
			rc = &rec{body: buf.String()}
			recs[key] = rc
			next++
			rc.answer = `{"id":` + string(rune('0'+next%10)) + `}`
		}
		mu.Unlock()
		switch {
		case !found:
			time.Sleep(200 * time.Millisecond)
			mu.Lock()
			rc.done = true
			mu.Unlock()
		case rc.body != buf.String():
			http.Error(w, "reused", http.StatusBadRequest)
			return
		default:
			mu.Lock()
			done := rc.done
			mu.Unlock()
			if !done {
				http.Error(w, "busy", http.StatusConflict) // no Retry-After
				return
			}
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(rc.answer)) // no Idempotent-Replayed
	}))
	defer srv.Close()
	rep := run(t, checker.Options{URL: srv.URL, Concurrency: 10})
	want := map[string]checker.Result{
		checker.CaseFirstRequest:    checker.Pass,
		checker.CaseReplay:          checker.Warn, // no Idempotent-Replayed
		checker.CaseChangedBody:     checker.Warn, // 400, not 422
		checker.CaseNewKey:          checker.Pass,
		checker.CaseMissingKey:      checker.Warn, // not a problem document
		checker.CaseLongKey:         checker.Warn, // accepted
		checker.CaseHangup:          checker.Warn, // no Idempotent-Replayed, no count: cannot tell
		checker.CaseRace:            checker.Warn, // 409 without Retry-After
		checker.CaseTenantIsolation: checker.Skip,
	}
	for _, c := range rep.Cases {
		if c.Result != want[c.Name] {
			t.Errorf("%s = %s (%s), want %s", c.Name, c.Result, c.Summary, want[c.Name])
		}
	}
	if rep.Failed() {
		t.Error("warnings alone made the report fail")
	}
	if t.Failed() {
		t.Log("\n" + table(rep))
	}
}

func TestInvalidOptions(t *testing.T) {
	t.Parallel()
	tests := map[string]checker.Options{
		"no URL":               {},
		"relative URL":         {URL: "/orders"},
		"ftp URL":              {URL: "ftp://h/orders"},
		"GET":                  {URL: "http://h/", Method: "get"},
		"concurrency 1":        {URL: "http://h/", Concurrency: 1},
		"count without mark":   {URL: "http://h/", CountURL: "http://h/orders"},
		"body without mark":    {URL: "http://h/", CountURL: "http://h/orders?c={{marker}}", Body: `{"a":1}`},
		"count path alone":     {URL: "http://h/", CountPath: "orders"},
		"unknown case":         {URL: "http://h/", Only: []string{"racy"}},
		"tenants without B":    {URL: "http://h/", Only: []string{checker.CaseRace, checker.CaseTenantIsolation}},
		"tenant B same as A":   {URL: "http://h/", Header: http.Header{"Authorization": {"Bearer a"}}, TenantBHeader: http.Header{"Authorization": {"Bearer a"}}},
		"negative rounds":      {URL: "http://h/", Rounds: -1},
		"relative count URL":   {URL: "http://h/", CountURL: "/orders?c={{marker}}"},
		"too much concurrency": {URL: "http://h/", Concurrency: checker.MaxConcurrency + 1},
	}
	for name, o := range tests {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rep, err := checker.Run(context.Background(), o)
			if !errors.Is(err, checker.ErrInvalidOptions) {
				t.Errorf("err = %v, want ErrInvalidOptions", err)
			}
			if rep != nil {
				t.Error("a report for invalid options")
			}
		})
	}
}

func TestCountJSON(t *testing.T) {
	t.Parallel()
	tests := []struct {
		doc, path string
		want      int
		err       bool
	}{
		{doc: `[1,2,3]`, want: 3},
		{doc: `[]`, want: 0},
		{doc: `{"total":9,"orders":[{"a":[1,2]},{"b":2}],"other":[1]}`, want: 2},
		{doc: `{"meta":{"n":1},"data":{"items":[[1],[2],[3],[4]]}}`, want: 4},
		{doc: `{"data":{"items":[1,2]},"total":7}`, path: "total", want: 7},
		{doc: `{"data":{"items":[1,2]},"total":7}`, path: "data.items", want: 2},
		{doc: `{"results":[{"orders":[1,2,3]}]}`, path: "results.0.orders", want: 3},
		{doc: `{"a":1}`, err: true},
		{doc: `not json`, err: true},
		{doc: `{"a":1}`, path: "b", err: true},
		{doc: `{"a":"x"}`, path: "a", err: true},
		{doc: `{"a":-1}`, path: "a", err: true},
		{doc: `{"a":[1]}`, path: "a.3", err: true},
	}
	for _, tt := range tests {
		got, err := checker.CountJSON([]byte(tt.doc), tt.path)
		if (err != nil) != tt.err || got != tt.want {
			t.Errorf("CountJSON(%s, %q) = %d, %v; want %d, error %v", tt.doc, tt.path, got, err, tt.want, tt.err)
		}
	}
}

func TestWriteJSONAndProgress(t *testing.T) {
	t.Parallel()
	srv := checkertest.NewServer(checkertest.CheckThenWrite)
	defer srv.Close()
	o := options(srv, false)
	o.Concurrency = 5
	var progress bytes.Buffer
	o.Progress = &progress
	rep := run(t, o)
	var buf bytes.Buffer
	if err := rep.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	var got struct {
		URL      string `json:"url"`
		Failed   bool   `json:"failed"`
		Failures int    `json:"failures"`
		Cases    []struct {
			Name       string   `json:"name"`
			Result     string   `json:"result"`
			DurationMS float64  `json:"duration_ms"`
			Summary    string   `json:"summary"`
			Evidence   []string `json:"evidence"`
		} `json:"cases"`
	}
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("%v in\n%s", err, buf.String())
	}
	fails := 0
	for _, c := range got.Cases {
		if c.Result == "fail" {
			fails++
		}
	}
	if got.URL != o.URL || !got.Failed || got.Failures != fails || fails == 0 || len(got.Cases) != len(checker.CaseNames()) {
		t.Errorf("url %q failed %v failures %d cases %d:\n%s", got.URL, got.Failed, got.Failures, len(got.Cases), buf.String())
	}
	for _, c := range got.Cases {
		if c.Name == checker.CaseRace && (c.Result != "fail" || len(c.Evidence) == 0 || c.DurationMS <= 0) {
			t.Errorf("race in JSON: %+v", c)
		}
	}
	if p := progress.String(); !strings.Contains(p, "\rrace: 5/5 connections dialled, 5/5 answered") || !strings.HasSuffix(p, "\n") {
		t.Errorf("progress = %q", p)
	}
}

func TestCanceledContext(t *testing.T) {
	t.Parallel()
	srv := checkertest.NewServer(checkertest.Correct)
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	rep, err := checker.Run(ctx, options(srv, false))
	if !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
	if rep == nil {
		t.Fatal("no report")
	}
}

// renamedMark rewrites the correct server's replay mark to another spelling,
// as servers in the wild do.
type renamedMark struct {
	http.ResponseWriter
	name string
}

func (w renamedMark) WriteHeader(code int) {
	if v := w.Header().Get("Idempotent-Replayed"); v != "" {
		w.Header().Del("Idempotent-Replayed")
		w.Header().Set(w.name, v)
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w renamedMark) Write(p []byte) (int, error) {
	if w.Header().Get("Idempotent-Replayed") != "" {
		w.WriteHeader(http.StatusOK)
	}
	return w.ResponseWriter.Write(p)
}

// TestOtherReplayMarkSpellings: a correct server that marks its replays with
// another common spelling (Idempotency-Replayed: true, X-Idempotent-Replayed, …)
// is seen to mark them: the replay case warns about the spelling, naming the
// header clients look for, not about a missing mark, and every other case
// passes as it does with the right spelling.
func TestOtherReplayMarkSpellings(t *testing.T) {
	t.Parallel()
	for _, name := range []string{"Idempotency-Replayed", "X-Idempotent-Replayed", "X-Idempotency-Replayed"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			inner := checkertest.Handler(checkertest.Correct)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				inner.ServeHTTP(renamedMark{w, name}, r)
			}))
			defer srv.Close()
			o := options(srv, true)
			o.Only = []string{checker.CaseFirstRequest, checker.CaseReplay, checker.CaseRace, checker.CaseTenantIsolation}
			rep := run(t, o)
			for _, c := range rep.Cases {
				want := checker.Pass
				if c.Name == checker.CaseReplay {
					want = checker.Warn
				}
				if c.Result != want {
					t.Errorf("case %s: %s (%s %q), want %s\n%s", c.Name, c.Result, c.Summary, c.Evidence, want, table(rep))
				}
				if c.Name != checker.CaseReplay {
					continue
				}
				if !strings.Contains(c.Summary, "marked with "+name+": true") || !strings.Contains(c.Summary, "clients look for Idempotent-Replayed: true") {
					t.Errorf("replay case says %q; want the spelling %s named and Idempotent-Replayed as the header clients read", c.Summary, name)
				}
				if strings.Contains(c.Summary, "no Idempotent-Replayed") || strings.Contains(c.Summary, "cannot tell a replay") {
					t.Errorf("replay case reports a missing mark: %q", c.Summary)
				}
			}
		})
	}
}
