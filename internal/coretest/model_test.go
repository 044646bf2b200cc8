package idem_test

// A stateful, property-based model of the middleware (pgregory.net/rapid).
//
// rapid generates sequences of actions against idem.New over a real loopback
// server (httptest.NewServer) whose clock (Config.NowFunc) only the model moves;
// a small reference model predicts every answer and every stored record, and the
// invariants are checked after every step. Shrinking turns a failure into a
// minimal sequence of actions, printed step by step.
//
// Actions:
//   - request: one keyed request — scope (none, two tenants, one longer than a
//     stored scope may be), key (bare or RFC 9651 quoted; k=3 only quoted is
//     valid), method POST/PATCH and lowercase variants, path, body — and the
//     handler outcome chosen for it: 201, slow 201, 400, 500, a panic
//     (http.ErrAbortHandler), a client hang-up while the handler runs, and with
//     SQLite a failing SQL statement the handler catches and answers 409 for,
//     and a row whose deferred foreign key makes SQLite refuse the COMMIT
//     while the handler answers 201 (500 idempotency_transaction_aborted, the
//     key released, nothing committed);
//   - hold/release (memory stores): a request whose handler blocks, so that
//     other requests, clock jumps and sweeps happen while it is in flight;
//   - burst: 2–4 identical requests released at the same moment;
//   - advance / boundary: the clock jumps by 1 s, half or a whole lease, a TTL, or
//     exactly to a record's lease deadline or expiry;
//   - crash: the middleware is dropped and rebuilt over the same records (memory:
//     the same store, as a shared one; SQLite: a new Store on the database, the
//     old one closed), optionally leaving an in-flight record behind, claimed
//     through the store as a crashed request's;
//   - sweep: idem.Janitor.Sweep on the model's clock.
//
// Each sequence draws its configuration: TTL equal to the lease or four times
// it, KeepFunc keeping everything or only status < 500, and with SQLite the
// claim-then-complete or the single-transaction flow.
//
// Invariants, after every step:
//   - every answer is the predicted one: a fresh handler answer, a byte-identical
//     replay of the one stored outcome (status, stored headers, body,
//     Idempotent-Replayed), 422 exactly when the fingerprint differs, 409 only
//     while a live lease exists (with the seconds left as Retry-After), 400 for an
//     invalid key;
//   - the handler ran at most once per record generation (each claim or
//     takeover), and exactly when the model says it must;
//   - what the store holds (Get) is what the model holds: state, fingerprint,
//     times, stored outcome; a sweep deletes exactly the expired records;
//   - SQLite: the rows the handler wrote are committed exactly for the executions
//     whose outcomes were stored;
//   - no answer is a retryable 5xx (503, or 500 with Retry-After): nothing in the
//     model is transient, so such an answer would send clients into retries that
//     can never succeed.
//
// The default run (rapid's 100 checks, each sequence cut at defaultBudget
// actions) takes about a second per store, a few under -race. Long mode, with
// rapid's full sequences (about -rapid.steps actions each) and no budget:
//
//	go test -run 'TestModel(Memstore|SQLite)$' -rapid.checks=50000 -rapid.steps=40 -timeout 3h .
//
// Giving -rapid.checks or -rapid.steps lifts the budget; -rapid.seed=N replays
// a run. TestModelCatchesPlantedBugs proves that the model fails on a store
// whose claim checks then writes and on one whose completion ignores the fence.

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// modelLease is the lease of every model run. The middleware renews a lease every
// Lease/3 of wall-clock time; at five minutes no renewal ever fires within a run,
// so the model's clock alone moves leases.
const modelLease = 5 * time.Minute

var (
	modelScopes  = []string{"t1", "", "t2", "tenant-" + strings.Repeat("x", 150)}
	modelKeys    = []string{"k1", "k2", "k=3"} // k=3 is valid only quoted
	modelMethods = []string{"post", "PATCH", "patch"}
)

func TestModelMemstore(t *testing.T) {
	t.Parallel()
	budget := modelBudget()
	rapid.Check(t, func(rt *rapid.T) {
		runModel(rt, memTarget(memstore.New(&memstore.Config{JanitorInterval: -1})), modelRun{budget: budget})
	})
}

func TestModelSQLite(t *testing.T) {
	t.Parallel()
	newTarget := sqliteModel(t)
	budget := modelBudget()
	rapid.Check(t, func(rt *rapid.T) { runModel(rt, newTarget(rt), modelRun{budget: budget}) })
}

// modelDir is the directory of the model's database files: in /dev/shm when
// there is one, because the model checks the logic, not durability, and a commit's
// fsync would otherwise take most of the run's time.
func modelDir(t *testing.T) string {
	dir, err := os.MkdirTemp("/dev/shm", "idem-model-")
	if err != nil {
		return t.TempDir()
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	return dir
}

// TestModelCatchesPlantedBugs runs the model, inside a captured check, against
// stores with a planted bug and asserts that it fails with a counterexample; and
// against the same store without the bug, asserting that it passes.
func TestModelCatchesPlantedBugs(t *testing.T) {
	// Not parallel: it sets rapid's flags (no fail files in the repository, a
	// shorter shrink) and restores them before the parallel tests start.
	for name, value := range map[string]string{"rapid.nofailfile": "true", "rapid.shrinktime": "10s"} {
		old := flag.Lookup(name).Value.String()
		if err := flag.Set(name, value); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = flag.Set(name, old) })
	}
	cases := []struct {
		name string
		bug  plantedBug
		want string // in the failure's counterexample
	}{
		{"correct store", 0, ""},
		{"claim checks then writes", bugCheckThenWrite, "handler ran"},
		// Only a completion of a request that lost its key can differ.
		{"complete without the fence", bugUnfencedComplete, "it still holds the key: false"},
	}
	// One tenant, one key: every action meets the planted bug's record.
	planted := modelRun{budget: 2 * defaultBudget, scopes: []string{"t1"}, keys: []string{"k1"}}
	for _, c := range cases {
		tb := &captureTB{name: "planted/" + c.name}
		rapid.Check(tb, func(rt *rapid.T) { runModel(rt, memTarget(newPlantedStore(c.bug)), planted) })
		out := tb.output()
		switch {
		case c.want == "" && tb.Failed():
			t.Errorf("%s: the model failed on a correct store:\n%s", c.name, out)
		case c.want != "" && !tb.Failed():
			t.Errorf("%s: the model did not catch the planted bug:\n%s", c.name, out)
		case c.want != "" && !strings.Contains(out, c.want):
			t.Errorf("%s: the model failed, but not on the planted bug (want %q in the output):\n%s", c.name, c.want, out)
		case c.want != "":
			t.Logf("%s: caught; rapid's counterexample:\n%s", c.name, counterexample(out))
		}
	}
}

// counterexample keeps the minimal failing sequence of rapid's output: the
// steps the model logged and the failure.
func counterexample(out string) string {
	var b strings.Builder
	for line := range strings.SplitSeq(out, "\n") {
		if strings.Contains(line, "step ") || strings.Contains(line, "FAIL") || strings.Contains(line, "[rapid] failed") {
			b.WriteString(line)
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// captureTB is a rapid.TB that records what rapid reports instead of failing the
// test, so that a test can assert that a property fails.
type captureTB struct {
	name   string
	mu     sync.Mutex
	failed bool
	out    strings.Builder
}

func (c *captureTB) Helper()      {}
func (c *captureTB) Name() string { return c.name }
func (c *captureTB) Logf(format string, args ...any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	fmt.Fprintf(&c.out, format+"\n", args...)
}
func (c *captureTB) Log(args ...any)                  { c.Logf("%s", fmt.Sprint(args...)) }
func (c *captureTB) Skipf(format string, args ...any) { c.Logf("SKIP "+format, args...) }
func (c *captureTB) Skip(args ...any)                 { c.Log(args...) }
func (c *captureTB) SkipNow()                         {}
func (c *captureTB) Errorf(format string, args ...any) {
	c.fail()
	c.Logf("FAIL "+format, args...)
}
func (c *captureTB) Error(args ...any)                 { c.fail(); c.Log(args...) }
func (c *captureTB) Fatalf(format string, args ...any) { c.Errorf(format, args...) }
func (c *captureTB) Fatal(args ...any)                 { c.Error(args...) }
func (c *captureTB) FailNow()                          { c.fail() }
func (c *captureTB) Fail()                             { c.fail() }
func (c *captureTB) Failed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.failed
}
func (c *captureTB) fail() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.failed = true
}
func (c *captureTB) output() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.out.String()
}

// target is the store under test and what the model may do with it.
type target struct {
	name    string
	store   idem.Store
	db      *sql.DB // SQLite: the database of the records and the handler's rows
	hold    bool    // requests may be held in flight (stores whose transactions do not serialize every write)
	sqlfail bool    // the handler may run a failing SQL statement
	// restart simulates a process crash: a new store over the same records.
	restart func(t *rapid.T) (idem.Store, *sql.DB)
	close   func()
}

// count is the number of records the store holds, expired ones included.
func (tg *target) count(t *rapid.T) int {
	if tg.db != nil {
		var n int
		if err := tg.db.QueryRow(`SELECT count(*) FROM model_records`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	return tg.store.(interface{ Len() int }).Len()
}

func memTarget(s idem.Store) *target {
	return &target{name: "memory", store: s, hold: true,
		restart: func(*rapid.T) (idem.Store, *sql.DB) { return s, nil }, // the records outlive the process
		close: func() {
			if c, ok := s.(io.Closer); ok {
				_ = c.Close()
			}
		}}
}

const modelOrdersSchema = `CREATE TABLE IF NOT EXISTS model_orders (exec INTEGER PRIMARY KEY, req TEXT NOT NULL)`

// modelRefusedSchema is the table of the "refused" outcome: its foreign key
// is checked at COMMIT, which SQLite then refuses for a missing order.
const modelRefusedSchema = `CREATE TABLE IF NOT EXISTS model_refused (req TEXT NOT NULL, exec INTEGER NOT NULL REFERENCES model_orders (exec) DEFERRABLE INITIALLY DEFERRED)`

// sqliteModel opens one database for all the checks of a run (opening one per
// check would prepare every statement anew on every connection) and returns the
// target of one check: the records and the handler's rows emptied.
func sqliteModel(t *testing.T) func(*rapid.T) *target {
	path := filepath.Join(modelDir(t), "model.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	newStore := func(tb rapid.TB) *sqlitestore.Store {
		s, err := sqlitestore.New(db, &sqlitestore.Config{Table: "model_records"})
		if err != nil {
			tb.Fatal(err)
		}
		return s
	}
	migrator := newStore(t)
	if err := migrator.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	_ = migrator.Close()
	// Row 0 exists so that the handler's failing statement is a real constraint violation.
	for _, q := range []string{modelOrdersSchema, modelRefusedSchema, `INSERT INTO model_orders (exec, req) VALUES (0, 'seed')`} {
		if _, err := db.Exec(q); err != nil {
			t.Fatal(err)
		}
	}
	var current *sqlitestore.Store
	return func(rt *rapid.T) *target {
		for _, q := range []string{`DELETE FROM model_records`, `DELETE FROM model_refused`, `DELETE FROM model_orders WHERE exec > 0`} {
			if _, err := db.Exec(q); err != nil {
				rt.Fatal(err)
			}
		}
		if current == nil {
			current = newStore(rt)
			t.Cleanup(func() { _ = current.Close() })
		}
		tg := &target{name: "sqlite", store: current, db: db, sqlfail: true, close: func() {}}
		// A crash: the process's store is gone, a new one is made over the same
		// database (the old one's prepared statements closed).
		tg.restart = func(rt *rapid.T) (idem.Store, *sql.DB) {
			_ = current.Close()
			current = newStore(rt)
			return current, db
		}
		return tg
	}
}

// fp is what the fingerprint covers: method (as sent), path and body.
type fp struct{ method, path, body string }

// mreq is one generated request.
type mreq struct {
	scope, key string
	quoted     bool
	fp
	outcome string // what the handler does if it runs
}

func (r mreq) String() string {
	k := r.key
	if r.quoted {
		k = strconv.Quote(k)
	}
	sc := r.scope
	if len(sc) > 12 {
		sc = sc[:12] + "…"
	}
	return fmt.Sprintf("%s %s body=%q scope=%q key=%s outcome=%s", r.method, r.path, r.body, sc, k, r.outcome)
}

func (r mreq) id() recID { return recID{r.scope, r.key} }

// validKey reports whether the key header is valid as spelled.
func (r mreq) validKey() bool { return r.quoted || r.key != "k=3" }

type recID struct{ scope, key string }

func (id recID) String() string {
	sc := id.scope
	if len(sc) > 12 {
		sc = sc[:12] + "…"
	}
	return fmt.Sprintf("(scope %q, key %q)", sc, id.key)
}

// respString shows a stored outcome readably.
func respString(r *idem.Response) string {
	if r == nil {
		return "none"
	}
	return fmt.Sprintf("%d %v %s", r.Status, r.Header, r.Body)
}

// mrec is the model of one stored record (present until released or deleted,
// expired or not).
type mrec struct {
	state                            idem.State
	fp                               fp
	owner                            string // the request (or crash token) holding or last holding the key
	gen                              int    // generation: a new one for every claim and takeover
	createdAt, leaseUntil, expiresAt time.Time
	resp                             manswer // stored outcome, when complete
	exec                             int     // the execution whose outcome is stored
	takeover                         bool    // the claim took a lapsed lease over
	replaced                         *mrec   // the (expired) record the claim replaced
}

// manswer is an answer as the model sees it: status, the stored headers, body.
type manswer struct {
	status           int
	ctype, location  string
	body             string
	withExtraHeaders bool // the handler also sent Set-Cookie and X-Not-Stored
}

// execRec is one execution of the handler.
type execRec struct {
	n       int
	req     string
	outcome string
	rid     recID
}

// handlerAnswer is what the handler answers in execution e.
func handlerAnswer(e execRec) manswer {
	body := fmt.Sprintf(`{"exec":%d,"req":%q,"outcome":%q}`, e.n, e.req, e.outcome)
	switch e.outcome {
	case "400":
		return manswer{status: 400, ctype: "application/problem+json", body: body}
	case "500":
		return manswer{status: 500, ctype: "text/plain; charset=utf-8", body: body}
	case "sqlfail":
		return manswer{status: 409, ctype: "text/plain; charset=utf-8", body: body}
	}
	return manswer{status: 201, ctype: "application/json", location: "/orders/" + strconv.Itoa(e.n), body: body, withExtraHeaders: true}
}

type harness struct {
	t       *rapid.T
	tg      *target
	scopes  []string
	keys    []string
	clock   modelClock
	ttl     time.Duration
	keepAll bool
	single  bool         // Config.Flow is FlowSingleTx
	mw      atomic.Value // http.Handler: the current middleware
	srv     *httptest.Server
	client  *http.Client
	step    int // actions done
	checked int // the step after which the invariants were last checked
	seq     int // request ids
	crashes int
	gens    int // record generations so far

	mu      sync.Mutex
	execs   []execRec
	started map[string]chan int
	gates   map[string]chan struct{}
	done    map[string]chan struct{}

	recs        map[recID]*mrec
	runs        map[string]int // executions per record generation
	storedExecs map[int]bool   // SQLite: executions whose outcome (and rows) committed
	held        *heldReq
}

type heldReq struct {
	r      mreq
	reqID  string
	exec   execRec
	result chan result
}

type result struct {
	a   *answer
	err error
}

type modelClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *modelClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *modelClock) set(t time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = t
}

// defaultBudget is the most actions of a sequence in the default run: it keeps
// the run to a few seconds per store under -race. Long mode (-rapid.checks or
// -rapid.steps given) has no budget.
const defaultBudget = 12

// modelBudget is the step budget of this run: defaultBudget, or none (0) when
// rapid's checks or steps were set on the command line.
func modelBudget() int {
	budget := defaultBudget
	flag.Visit(func(f *flag.Flag) {
		if f.Name == "rapid.checks" || f.Name == "rapid.steps" {
			budget = 0
		}
	})
	return budget
}

// modelRun is what one run of the model may do.
type modelRun struct {
	budget int      // the most actions of a sequence; 0: no bound
	scopes []string // default modelScopes
	keys   []string // default modelKeys
}

// runModel runs one generated sequence against tg.
func runModel(t *rapid.T, tg *target, run modelRun) {
	budget := run.budget
	h := &harness{
		t: t, tg: tg, scopes: modelScopes, keys: modelKeys,
		ttl:     rapid.SampledFrom([]time.Duration{modelLease, 4 * modelLease}).Draw(t, "ttl"),
		keepAll: rapid.Bool().Draw(t, "keepAll"),
		started: map[string]chan int{}, gates: map[string]chan struct{}{}, done: map[string]chan struct{}{},
		recs: map[recID]*mrec{}, runs: map[string]int{}, storedExecs: map[int]bool{},
	}
	if _, ok := tg.store.(idem.SingleTxStore); ok && tg.db != nil {
		h.single = rapid.Bool().Draw(t, "singleTx")
	}
	if run.scopes != nil {
		h.scopes, h.keys = run.scopes, run.keys
	}
	t.Logf("step 0: %s store, lease %v, TTL %v, keep every outcome: %v, single transaction flow: %v", tg.name, modelLease, h.ttl, h.keepAll, h.single)
	h.clock.set(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	h.buildMiddleware()
	h.srv = httptest.NewServer(http.HandlerFunc(h.serve))
	// One attempt per request: no connection reuse, so no transparent re-send.
	h.client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 20 * time.Second}
	t.Cleanup(func() {
		h.mu.Lock()
		for id, g := range h.gates {
			close(g)
			delete(h.gates, id)
		}
		h.mu.Unlock()
		h.srv.Close()
		h.tg.close()
	})
	// Past the step budget, actions do nothing (rapid still draws them).
	act := func(f func(*rapid.T)) func(*rapid.T) {
		return func(t *rapid.T) {
			if budget == 0 || h.step < budget {
				f(t)
			}
		}
	}
	t.Repeat(map[string]func(*rapid.T){
		"request":  act(h.actRequest),
		"hold":     act(h.actHold),
		"release":  act(h.actRelease),
		"burst":    act(h.actBurst),
		"advance":  act(h.actAdvance),
		"boundary": act(h.actBoundary),
		"crash":    act(h.actCrash),
		"sweep":    act(h.actSweep),
		"": func(t *rapid.T) {
			if h.checked < h.step || h.step == 0 {
				h.checked = h.step
				h.check(t)
			}
		},
	})
}

func (h *harness) buildMiddleware() {
	// The flow is named, never FlowAuto: the model must know which one runs.
	cfg := &idem.Config{Lease: modelLease, TTL: h.ttl, NowFunc: h.clock.Now, Flow: idem.FlowClaimComplete}
	if h.single {
		cfg.Flow = idem.FlowSingleTx
	}
	if !h.keepAll {
		cfg.KeepFunc = func(status int) bool { return status < 500 }
	}
	mw, err := idem.New(h.tg.store, cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	h.mw.Store(mw(http.HandlerFunc(h.business)))
}

// serve is the server: the scope from X-Model-Scope, then the current middleware.
func (h *harness) serve(w http.ResponseWriter, r *http.Request) {
	id := r.Header.Get("X-Model-Req")
	h.mu.Lock()
	done := h.done[id]
	h.mu.Unlock()
	if done != nil {
		defer close(done)
	}
	if sc, ok := r.Header["X-Model-Scope"]; ok {
		r = r.WithContext(idem.WithScope(r.Context(), sc[0]))
	}
	h.mw.Load().(http.Handler).ServeHTTP(w, r)
}

// business is the handler behind idem: it logs its execution, writes a row in
// the request's transaction (SQLite) and answers as the request's outcome says.
func (h *harness) business(w http.ResponseWriter, r *http.Request) {
	id, outcome := r.Header.Get("X-Model-Req"), r.Header.Get("X-Model-Outcome")
	_, _ = io.Copy(io.Discard, r.Body)
	sc, key, _ := idem.KeyFrom(r.Context())
	h.mu.Lock()
	n := len(h.execs) + 1
	h.execs = append(h.execs, execRec{n: n, req: id, outcome: outcome, rid: recID{sc, key}})
	started, gate := h.started[id], h.gates[id]
	h.mu.Unlock()
	if started != nil {
		started <- n
	}
	if gate != nil {
		<-gate
	}
	if outcome == "slow" {
		time.Sleep(2 * time.Millisecond)
	}
	if h.tg.db != nil {
		tx := sqlitestore.Tx(r.Context())
		if tx == nil {
			http.Error(w, "no transaction", 599)
			return
		}
		if _, err := tx.ExecContext(r.Context(), `INSERT INTO model_orders (exec, req) VALUES (?, ?)`, n, id); err != nil {
			http.Error(w, "insert: "+err.Error(), 598)
			return
		}
		if outcome == "refused" {
			if _, err := tx.ExecContext(r.Context(), `INSERT INTO model_refused (req, exec) VALUES (?, -1)`, id); err != nil {
				http.Error(w, "insert the refused row: "+err.Error(), 596)
				return
			}
		}
		if outcome == "sqlfail" {
			if _, err := tx.ExecContext(r.Context(), `INSERT INTO model_orders (exec, req) VALUES (0, ?)`, id); err == nil {
				http.Error(w, "the duplicate row was accepted", 597)
				return
			}
		}
	}
	if outcome == "panic" {
		panic(http.ErrAbortHandler)
	}
	a := handlerAnswer(execRec{n: n, req: id, outcome: outcome})
	w.Header().Set("Content-Type", a.ctype)
	if a.location != "" {
		w.Header().Set("Location", a.location)
	}
	if a.withExtraHeaders {
		w.Header().Set("Set-Cookie", "session=secret")
		w.Header().Set("X-Not-Stored", "x")
	}
	w.WriteHeader(a.status)
	_, _ = io.WriteString(w, a.body)
}

// drawReq draws a request; most reuse the key's usual request, so that replays,
// takeovers and mismatches all happen.
func (h *harness) drawReq(t *rapid.T, outcomes []string) mreq {
	r := mreq{
		scope:  skewed(t, "scope", h.scopes),
		key:    skewed(t, "key", h.keys),
		quoted: rapid.Bool().Draw(t, "quoted"),
	}
	r.fp = fp{"POST", "/orders", `{"item":"lamp"}`}
	switch rapid.IntRange(0, 9).Draw(t, "variant") {
	case 7:
		r.method = rapid.SampledFrom(modelMethods).Draw(t, "method")
	case 8:
		r.path = "/orders/7"
	case 9:
		r.body = `{"item":"desk"}`
	}
	r.outcome = rapid.SampledFrom(outcomes).Draw(t, "outcome")
	return r
}

// skewed draws from items, the first one three times as often as all the others
// together, so that most requests meet a record an earlier one left.
func skewed(t *rapid.T, label string, items []string) string {
	if len(items) == 1 || rapid.IntRange(0, 3).Draw(t, label+"Other") < 3 {
		return items[0]
	}
	return rapid.SampledFrom(items[1:]).Draw(t, label)
}

func (h *harness) outcomes() []string {
	o := []string{"201", "slow", "400", "500", "panic", "hangup"}
	if h.tg.sqlfail {
		o = append(o, "sqlfail", "refused")
	}
	return o
}

func (h *harness) newReqID() string {
	h.seq++
	return "r" + strconv.Itoa(h.seq)
}

// httpRequest builds r with request id id.
func (h *harness) httpRequest(ctx context.Context, r mreq, id string) *http.Request {
	req, err := http.NewRequestWithContext(ctx, r.method, h.srv.URL+r.path, strings.NewReader(r.body))
	if err != nil {
		h.t.Fatal(err)
	}
	k := r.key
	if r.quoted {
		k = `"` + k + `"`
	}
	req.Header.Set("Idempotency-Key", k)
	if r.scope != "" {
		req.Header.Set("X-Model-Scope", r.scope)
	}
	req.Header.Set("X-Model-Req", id)
	req.Header.Set("X-Model-Outcome", r.outcome)
	return req
}

// register prepares the channels of request id.
func (h *harness) register(id string, started, gate bool) (chan int, chan struct{}, chan struct{}) {
	h.mu.Lock()
	defer h.mu.Unlock()
	done := make(chan struct{})
	h.done[id] = done
	var s chan int
	var g chan struct{}
	if started {
		s = make(chan int, 1)
		h.started[id] = s
	}
	if gate {
		g = make(chan struct{})
		h.gates[id] = g
	}
	return s, g, done
}

func (h *harness) do(req *http.Request) result {
	resp, err := h.client.Do(req)
	if err != nil {
		return result{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return result{err: err}
	}
	return result{a: &answer{resp.StatusCode, resp.Header, b}}
}

// waitDone waits until the server finished request id (its outcome settled).
func (h *harness) waitDone(id string, done chan struct{}) {
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		h.t.Fatalf("request %s: the server did not finish within 20s", id)
	}
	h.mu.Lock()
	delete(h.done, id)
	delete(h.started, id)
	delete(h.gates, id)
	h.mu.Unlock()
}

func (h *harness) execCount() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.execs)
}

func (h *harness) execsSince(n int) []execRec {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.execs[n:])
}

// prediction is what the model expects for a request at the current time.
type prediction struct {
	kind       string // reject, mismatch, inflight, replay, execute
	retryAfter int
	takeover   bool
	rec        *mrec
}

func (h *harness) predict(r mreq) prediction {
	if !r.validKey() {
		return prediction{kind: "reject"}
	}
	now := h.clock.Now()
	rec := h.recs[r.id()]
	if rec == nil || !rec.expiresAt.After(now) {
		return prediction{kind: "execute"}
	}
	switch {
	case rec.fp != r.fp:
		return prediction{kind: "mismatch", rec: rec}
	case rec.state == idem.StateComplete:
		return prediction{kind: "replay", rec: rec}
	case rec.leaseUntil.After(now):
		left := rec.leaseUntil.Sub(now)
		return prediction{kind: "inflight", rec: rec, retryAfter: max(1, int((left+time.Second-1)/time.Second))}
	}
	return prediction{kind: "execute", takeover: true, rec: rec}
}

// claim applies a successful claim of r by owner to the model.
func (h *harness) claim(r mreq, owner string, takeover bool) *mrec {
	now := h.clock.Now()
	old := h.recs[r.id()]
	rec := &mrec{state: idem.StateInFlight, fp: r.fp, owner: owner, createdAt: now,
		leaseUntil: now.Add(modelLease), expiresAt: now.Add(h.ttl)}
	h.gens++
	rec.gen = h.gens
	rec.takeover, rec.replaced = takeover, old
	if old != nil && takeover {
		rec.createdAt = old.createdAt
	}
	h.recs[r.id()] = rec
	return rec
}

// settle applies the end of execution e of the request owning rec to the model:
// the outcome is stored, or the key released.
func (h *harness) settle(id recID, e execRec) {
	rec := h.recs[id]
	if e.outcome == "panic" || e.outcome == "refused" || (!h.keepAll && handlerAnswer(e).status >= 500) {
		delete(h.recs, id)
		if h.single && !rec.takeover && rec.replaced != nil {
			// The single transaction wrote nothing: the expired record it would
			// have replaced is still there.
			h.recs[id] = rec.replaced
		}
		return
	}
	now := h.clock.Now()
	rec.state, rec.resp, rec.exec, rec.expiresAt = idem.StateComplete, handlerAnswer(e), e.n, now.Add(h.ttl)
	if h.tg.db != nil {
		h.storedExecs[e.n] = true
	}
}

func (h *harness) logf(format string, args ...any) {
	h.step++
	h.t.Logf("step %d [t=%v]: %s", h.step, h.clock.Now().Sub(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)), fmt.Sprintf(format, args...))
}

func (h *harness) actRequest(t *rapid.T) {
	r := h.drawReq(t, h.outcomes())
	h.request(t, r, "request")
}

func (h *harness) request(t *rapid.T, r mreq, what string) {
	p := h.predict(r)
	h.logf("%s %v → expect %s", what, r, p.kind)
	id := h.newReqID()
	hangup := p.kind == "execute" && r.outcome == "hangup"
	started, gate, done := h.register(id, hangup, hangup)
	n0 := h.execCount()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resc := make(chan result, 1)
	go func() { resc <- h.do(h.httpRequest(ctx, r, id)) }()
	var res result
	if hangup {
		// The client hangs up while the handler runs; the handler goes on (and
		// answers) only once the client is gone.
		select {
		case <-started:
			cancel()
		case <-time.After(20 * time.Second):
			t.Fatalf("the handler of %s never started", id)
		}
		res = <-resc
		h.mu.Lock()
		close(gate)
		delete(h.gates, id)
		h.mu.Unlock()
	} else {
		res = <-resc
	}
	h.waitDone(id, done)
	execs := h.execsSince(n0)
	h.noRetryable5xx(res)
	if p.kind != "execute" {
		if len(execs) != 0 {
			t.Fatalf("the handler ran %d times for a request the model answers with %s", len(execs), p.kind)
		}
		h.expectNoExec(p, res)
		return
	}
	if len(execs) != 1 {
		t.Fatalf("the handler ran %d times for one claimable request, want once", len(execs))
	}
	e := execs[0]
	rec := h.claim(r, id, p.takeover)
	h.countRun(r.id(), rec.gen)
	switch e.outcome {
	case "panic":
		if res.err == nil {
			t.Fatalf("the handler panicked but the client got %d %s", res.a.status, res.a.body)
		}
	case "hangup":
		if res.err == nil {
			t.Fatalf("the client hung up but got %d %s", res.a.status, res.a.body)
		}
	case "refused":
		// SQLite refused the COMMIT: nothing committed, and the 201 the
		// handler answered is not true.
		if res.err != nil {
			t.Fatalf("request failed: %v", res.err)
		}
		h.expectProblem(res.a, 500, idem.CodeTxAborted, 0)
	default:
		h.expectFresh(res, handlerAnswer(e))
	}
	h.settle(r.id(), e)
}

func (h *harness) countRun(id recID, gen int) {
	k := fmt.Sprintf("%v generation %d", id, gen)
	h.runs[k]++
	if h.runs[k] > 1 {
		h.t.Fatalf("the handler ran %d times for one record generation (%s)", h.runs[k], k)
	}
}

func (h *harness) expectNoExec(p prediction, res result) {
	t := h.t
	if res.err != nil {
		t.Fatalf("request failed: %v", res.err)
	}
	a := res.a
	switch p.kind {
	case "reject":
		h.expectProblem(a, 400, idem.CodeKeyInvalid, 0)
	case "mismatch":
		h.expectProblem(a, 422, idem.CodeKeyReused, 0)
	case "inflight":
		h.expectProblem(a, 409, idem.CodeKeyInUse, p.retryAfter)
	case "replay":
		h.expectReplay(a, p.rec.resp)
	}
}

func (h *harness) expectProblem(a *answer, status int, code string, retryAfter int) {
	var p idem.Problem
	_ = json.Unmarshal(a.body, &p)
	if a.status != status || p.Code != code || a.header.Get("Content-Type") != "application/problem+json" {
		h.t.Fatalf("answer %d %s, want %d %s", a.status, a.body, status, code)
	}
	if got := a.header.Get("Retry-After"); retryAfter > 0 && got != strconv.Itoa(retryAfter) {
		h.t.Fatalf("409 with Retry-After %q, want %d (the seconds left on the lease)", got, retryAfter)
	}
}

func (h *harness) expectFresh(res result, want manswer) {
	if res.err != nil {
		h.t.Fatalf("request failed: %v", res.err)
	}
	a := res.a
	if a.status != want.status || string(a.body) != want.body || a.header.Get("Content-Type") != want.ctype ||
		a.header.Get("Location") != want.location || a.header.Get(idem.ReplayedHeader) != "" ||
		(want.withExtraHeaders && a.header.Get("Set-Cookie") == "") {
		h.t.Fatalf("answer %d %s %v, want the handler's fresh answer %d %s", a.status, a.body, a.header, want.status, want.body)
	}
}

func (h *harness) expectReplay(a *answer, want manswer) {
	if a.status != want.status || string(a.body) != want.body || a.header.Get("Content-Type") != want.ctype ||
		a.header.Get("Location") != want.location || a.header.Get(idem.ReplayedHeader) != "true" ||
		a.header.Get("Set-Cookie") != "" || a.header.Get("X-Not-Stored") != "" {
		h.t.Fatalf("answer %d %s %v, want the replay of the stored outcome %d %s", a.status, a.body, a.header, want.status, want.body)
	}
}

// noRetryable5xx: nothing in the model is transient, so a 503, or a 500 with
// Retry-After, would send a client into retries that can never succeed.
func (h *harness) noRetryable5xx(res result) {
	if res.a == nil {
		return
	}
	if res.a.status == 503 || (res.a.status == 500 && res.a.header.Get("Retry-After") != "") {
		h.t.Fatalf("a retryable %d (Retry-After %q) where nothing is transient: %s", res.a.status, res.a.header.Get("Retry-After"), res.a.body)
	}
}

func (h *harness) actHold(t *rapid.T) {
	if !h.tg.hold || h.held != nil {
		t.Skip("no hold")
	}
	r := h.drawReq(t, []string{"201", "400", "500", "panic"})
	p := h.predict(r)
	if p.kind != "execute" {
		h.request(t, r, "request (hold)")
		return
	}
	h.logf("hold %v → expect execute, handler held", r)
	id := h.newReqID()
	started, gate, done := h.register(id, true, true)
	n0 := h.execCount()
	hr := &heldReq{r: r, reqID: id, result: make(chan result, 1)}
	_, _ = gate, done // release closes the gate and waits for done
	go func() { hr.result <- h.do(h.httpRequest(context.Background(), r, id)) }()
	select {
	case <-started:
	case <-time.After(20 * time.Second):
		t.Fatalf("the held handler of %s never started", id)
	}
	execs := h.execsSince(n0)
	if len(execs) != 1 {
		t.Fatalf("the handler ran %d times for one claimable request, want once", len(execs))
	}
	hr.exec = execs[0]
	rec := h.claim(r, id, p.takeover)
	h.countRun(r.id(), rec.gen)
	h.held = hr
}

func (h *harness) actRelease(t *rapid.T) {
	hr := h.held
	if hr == nil {
		t.Skip("nothing held")
	}
	h.held = nil
	rec := h.recs[hr.r.id()]
	owns := rec != nil && rec.state == idem.StateInFlight && rec.owner == hr.reqID
	h.logf("release %s (%v); it still holds the key: %v", hr.reqID, hr.r, owns)
	n0 := h.execCount()
	h.mu.Lock()
	done := h.done[hr.reqID]
	close(h.gates[hr.reqID])
	delete(h.gates, hr.reqID)
	h.mu.Unlock()
	var res result
	select {
	case res = <-hr.result:
	case <-time.After(20 * time.Second):
		t.Fatalf("the released request %s did not answer", hr.reqID)
	}
	h.waitDone(hr.reqID, done)
	h.noRetryable5xx(res)
	if n := len(h.execsSince(n0)); n != 0 {
		t.Fatalf("%d more executions while releasing one held request", n)
	}
	if hr.exec.outcome == "panic" {
		if res.err == nil {
			t.Fatalf("the handler panicked but the client got %d %s", res.a.status, res.a.body)
		}
	} else {
		// Without a transaction the handler's effects happened: its client hears
		// its answer whether or not the outcome could be stored.
		h.expectFresh(res, handlerAnswer(hr.exec))
	}
	if owns {
		h.settle(hr.r.id(), hr.exec)
	}
}

func (h *harness) actBurst(t *rapid.T) {
	r := h.drawReq(t, []string{"201"})
	n := rapid.IntRange(2, 4).Draw(t, "n")
	p := h.predict(r)
	h.logf("burst of %d × %v → expect %s", n, r, p.kind)
	n0 := h.execCount()
	start := make(chan struct{})
	ids := make([]string, n)
	dones := make([]chan struct{}, n)
	results := make([]result, n)
	var wg sync.WaitGroup
	for i := range n {
		ids[i] = h.newReqID()
		_, _, dones[i] = h.register(ids[i], false, false)
		req := h.httpRequest(context.Background(), r, ids[i])
		wg.Go(func() {
			<-start
			results[i] = h.do(req)
		})
	}
	close(start)
	wg.Wait()
	for i := range n {
		h.waitDone(ids[i], dones[i])
	}
	execs := h.execsSince(n0)
	for _, res := range results {
		h.noRetryable5xx(res)
	}
	if p.kind != "execute" {
		if len(execs) != 0 {
			t.Fatalf("the handler ran %d times for a burst the model answers with %s", len(execs), p.kind)
		}
		for _, res := range results {
			h.expectNoExec(p, res)
		}
		return
	}
	if len(execs) != 1 {
		t.Fatalf("the handler ran %d times for a burst of %d identical requests, want once", len(execs), n)
	}
	e := execs[0]
	want := handlerAnswer(e)
	for i, res := range results {
		if res.err != nil {
			t.Fatalf("burst request %s failed: %v", ids[i], res.err)
		}
		switch {
		case ids[i] == e.req:
			h.expectFresh(res, want)
		case res.a.status == 409:
			retryAfter := int(modelLease / time.Second) // the lease left
			if h.single && res.a.header.Get("Retry-After") == "1" {
				retryAfter = 1 // the single transaction's lock has no lease
			}
			h.expectProblem(res.a, 409, idem.CodeKeyInUse, retryAfter)
		default:
			h.expectReplay(res.a, want)
		}
	}
	rec := h.claim(r, e.req, p.takeover)
	h.countRun(r.id(), rec.gen)
	h.settle(r.id(), e)
}

func (h *harness) actAdvance(t *rapid.T) {
	d := rapid.SampledFrom([]time.Duration{time.Second, 30 * time.Second, modelLease / 2, modelLease - time.Second, modelLease, modelLease + time.Second, h.ttl, h.ttl + time.Second}).Draw(t, "advance")
	h.clock.set(h.clock.Now().Add(d))
	h.logf("clock advanced by %v", d)
}

func (h *harness) actBoundary(t *rapid.T) {
	now := h.clock.Now()
	var points []time.Time
	for _, id := range h.sortedIDs() {
		rec := h.recs[id]
		for _, p := range []time.Time{rec.leaseUntil, rec.expiresAt} {
			if p.After(now) {
				points = append(points, p)
			}
		}
	}
	if len(points) == 0 {
		t.Skip("no deadline ahead")
	}
	p := rapid.SampledFrom(points).Draw(t, "deadline")
	h.clock.set(p)
	h.logf("clock set to a record's lease deadline or expiry")
}

func (h *harness) sortedIDs() []recID {
	ids := make([]recID, 0, len(h.recs))
	for id := range h.recs {
		ids = append(ids, id)
	}
	slices.SortFunc(ids, func(a, b recID) int { return strings.Compare(a.scope+"\x00"+a.key, b.scope+"\x00"+b.key) })
	return ids
}

func (h *harness) actCrash(t *rapid.T) {
	if h.held != nil {
		t.Skip("a request is held")
	}
	h.tg.store, h.tg.db = h.tg.restart(t)
	h.buildMiddleware()
	if !rapid.Bool().Draw(t, "leaveInFlight") {
		h.logf("crash and restart")
		return
	}
	r := h.drawReq(t, []string{"201"})
	p := h.predict(r)
	h.crashes++
	token := "crash-" + strconv.Itoa(h.crashes)
	h.logf("crash and restart, leaving %v in flight (%s) → claimable: %v", r, token, p.kind == "execute")
	if !r.validKey() {
		return
	}
	now := h.clock.Now()
	body := []byte(r.body)
	fpr := idem.FingerprintV3(httptest.NewRequest(r.method, r.path, nil), body)
	_, claimed, err := h.tg.store.Claim(context.Background(), idem.ClaimRequest{
		Scope: idem.StoredScope(r.scope), Key: r.key, Fingerprint: fpr, Token: token,
		Now: now, LeaseUntil: now.Add(modelLease), ExpiresAt: now.Add(h.ttl),
	})
	if err != nil {
		t.Fatalf("claim: %v", err)
	}
	if claimed != (p.kind == "execute") {
		t.Fatalf("Store.Claim claimed = %v, the model says %s", claimed, p.kind)
	}
	if claimed {
		h.claim(r, token, p.takeover)
	}
}

func (h *harness) actSweep(t *rapid.T) {
	now := h.clock.Now()
	want := 0
	for id, rec := range h.recs {
		if !rec.expiresAt.After(now) {
			want++
			delete(h.recs, id)
		}
	}
	j := idem.Janitor{Store: h.tg.store, NowFunc: h.clock.Now, BatchSize: 2}
	n, err := j.Sweep(context.Background())
	h.logf("janitor sweep → expect %d deleted", want)
	if err != nil || n != want {
		t.Fatalf("sweep deleted %d (%v), want %d", n, err, want)
	}
}

// check compares the store and the committed rows with the model.
func (h *harness) check(t *rapid.T) {
	now := h.clock.Now()
	ctx := context.Background()
	// Every record the store holds, expired or not, is one the model holds: no
	// phantom, none missing, none left behind by a release or a sweep.
	if n, m := h.tg.count(t), len(h.recs); n != m {
		t.Fatalf("the store holds %d records, the model %d", n, m)
	}
	for _, id := range h.sortedIDs() {
		rec := h.recs[id]
		got, err := h.tg.store.Get(ctx, idem.StoredScope(id.scope), id.key, now)
		if !rec.expiresAt.After(now) {
			if !errors.Is(err, idem.ErrNotFound) {
				t.Fatalf("record %v: Get = %+v, %v; the model's record expired", id, got, err)
			}
			continue
		}
		if err != nil {
			t.Fatalf("record %v: Get: %v; the model has a %s record", id, err, rec.state)
		}
		wantFP := idem.FingerprintV3(httptest.NewRequest(rec.fp.method, rec.fp.path, nil), []byte(rec.fp.body))
		if got.State != rec.state || got.Fingerprint != wantFP || !got.CreatedAt.Equal(rec.createdAt) || !got.ExpiresAt.Equal(rec.expiresAt) {
			t.Fatalf("record %v: store has %s created %v expires %v, the model %s created %v expires %v",
				id, got.State, got.CreatedAt, got.ExpiresAt, rec.state, rec.createdAt, rec.expiresAt)
		}
		if rec.state == idem.StateInFlight {
			if !got.LeaseUntil.Equal(rec.leaseUntil) || (strings.HasPrefix(rec.owner, "crash-") && got.Token != rec.owner) {
				t.Fatalf("record %v: store has lease %v token %s, the model %v %s", id, got.LeaseUntil, got.Token, rec.leaseUntil, rec.owner)
			}
			continue
		}
		resp := got.Response
		if resp == nil || resp.Status != rec.resp.status || string(resp.Body) != rec.resp.body ||
			resp.Header.Get("Content-Type") != rec.resp.ctype || resp.Header.Get("Location") != rec.resp.location ||
			resp.Header.Get("Set-Cookie") != "" || resp.Header.Get("X-Not-Stored") != "" {
			t.Fatalf("record %v: stored outcome %s, but the model stored execution %d: %d %s", id, respString(resp), rec.exec, rec.resp.status, rec.resp.body)
		}
	}
	if h.tg.db == nil {
		return
	}
	rows, err := h.tg.db.QueryContext(ctx, `SELECT exec FROM model_orders WHERE exec > 0 ORDER BY exec`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var committed []int
	for rows.Next() {
		var n int
		if err := rows.Scan(&n); err != nil {
			t.Fatal(err)
		}
		committed = append(committed, n)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	var stored []int
	for n := range h.storedExecs {
		stored = append(stored, n)
	}
	slices.Sort(stored)
	if !slices.Equal(committed, stored) {
		t.Fatalf("rows committed by executions %v, outcomes stored for executions %v: they must commit together", committed, stored)
	}
}

// plantedBug names a defect planted in plantedStore.
type plantedBug int

const (
	// bugCheckThenWrite: Claim reads the record, then writes unconditionally
	// (a round trip later), instead of deciding in one atomic step.
	bugCheckThenWrite plantedBug = iota + 1
	// bugUnfencedComplete: Complete stores the outcome whoever holds the key.
	bugUnfencedComplete
)

// plantedStore is a small in-memory idem.Store, correct but for its planted bug.
type plantedStore struct {
	bug  plantedBug
	mu   sync.Mutex
	recs map[recID]*idem.Record
}

func newPlantedStore(bug plantedBug) *plantedStore {
	return &plantedStore{bug: bug, recs: map[recID]*idem.Record{}}
}

func (s *plantedStore) claimable(old *idem.Record, req idem.ClaimRequest) bool {
	return old == nil || !old.ExpiresAt.After(req.Now) ||
		(old.State == idem.StateInFlight && !old.LeaseUntil.After(req.Now) && old.Fingerprint == req.Fingerprint)
}

func (s *plantedStore) Claim(_ context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	id := recID{req.Scope, req.Key}
	s.mu.Lock()
	defer s.mu.Unlock()
	old := s.recs[id]
	if !s.claimable(old, req) {
		return old, false, nil
	}
	if s.bug == bugCheckThenWrite {
		s.mu.Unlock()
		time.Sleep(2 * time.Millisecond) // the round trip between the check and the write
		s.mu.Lock()
	}
	rec := &idem.Record{Scope: req.Scope, Key: req.Key, State: idem.StateInFlight, Fingerprint: req.Fingerprint,
		Token: req.Token, CreatedAt: req.Now, LeaseUntil: req.LeaseUntil, ExpiresAt: req.ExpiresAt}
	if old != nil && old.ExpiresAt.After(req.Now) {
		rec.CreatedAt = old.CreatedAt
	}
	s.recs[id] = rec
	return rec, true, nil
}

// held returns the record in flight under token, or nil; s.mu is held.
func (s *plantedStore) held(scope, key, token string) *idem.Record {
	rec := s.recs[recID{scope, key}]
	if rec == nil || rec.State != idem.StateInFlight || rec.Token != token {
		return nil
	}
	return rec
}

func (s *plantedStore) Complete(_ context.Context, scope, key, token string, resp *idem.Response, _, expiresAt time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec := s.held(scope, key, token)
	if s.bug == bugUnfencedComplete {
		rec = s.recs[recID{scope, key}]
	}
	if rec == nil {
		return idem.ErrLockLost
	}
	done := *rec
	done.State, done.Response, done.ExpiresAt = idem.StateComplete, resp, expiresAt
	s.recs[recID{scope, key}] = &done
	return nil
}

func (s *plantedStore) Release(_ context.Context, scope, key, token string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held(scope, key, token) == nil {
		return idem.ErrLockLost
	}
	delete(s.recs, recID{scope, key})
	return nil
}

func (s *plantedStore) Extend(_ context.Context, scope, key, token string, _, leaseUntil time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec := s.held(scope, key, token)
	if rec == nil {
		return idem.ErrLockLost
	}
	ext := *rec
	ext.LeaseUntil = leaseUntil
	if ext.ExpiresAt.Before(leaseUntil) {
		ext.ExpiresAt = leaseUntil
	}
	s.recs[recID{scope, key}] = &ext
	return nil
}

func (s *plantedStore) Get(_ context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec := s.recs[recID{scope, key}]
	if rec == nil || !rec.ExpiresAt.After(now) {
		return nil, idem.ErrNotFound
	}
	return rec, nil
}

func (s *plantedStore) DeleteExpired(_ context.Context, now time.Time, limit int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for id, rec := range s.recs {
		if n < limit && !rec.ExpiresAt.After(now) {
			delete(s.recs, id)
			n++
		}
	}
	return n, nil
}

// Len is the number of records held, expired ones included.
func (s *plantedStore) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.recs)
}

// Found by the model (TestModelSQLite, a burst on a completed key in the single
// transaction flow): concurrent retries of an operation that completed long ago
// were answered 409 idempotency_key_in_use (Retry-After: 1) instead of its
// replay, although no request held the key: BeginLocked took the store's per-key
// lock before it read the record, so a replay that was only reading the key made
// every other request with it a 409 — and a request with another body a 409
// instead of its 422. Fixed in sqlitestore: a complete record is answered from a
// lock-free read.
func TestSingleTxConcurrentReplaysAreReplays(t *testing.T) {
	t.Parallel()
	store := newSQLiteStore(t)
	mw, err := idem.New(store, &idem.Config{Flow: idem.FlowSingleTx})
	if err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":1}`)
	})))
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}}
	if a := b.post(t, "k", "{}"); a.status != http.StatusCreated {
		t.Fatalf("first request: %d %s", a.status, a.body)
	}
	// The operation is complete: every retry, however many at once, is its replay.
	for round := 0; round < 20; round++ {
		const n = 8
		answers := make([]answer, n)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range n {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
			req.Header.Set("Idempotency-Key", "k")
			wg.Go(func() {
				<-start
				resp, err := b.client.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				defer resp.Body.Close()
				body, _ := io.ReadAll(resp.Body)
				answers[i] = answer{resp.StatusCode, resp.Header, body}
			})
		}
		close(start)
		wg.Wait()
		for _, a := range answers {
			if a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" {
				t.Fatalf("round %d: a concurrent retry of a completed operation got %d %s (Retry-After %q), want its replay",
					round, a.status, a.body, a.header.Get("Retry-After"))
			}
		}
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want once", n)
	}
}
