package idem_test

// A stateful, property-based model of the middleware's steps (idem.Step,
// issue 27), with pgregory.net/rapid, over a real loopback server whose clock
// only the model moves.
//
// The handler of every request runs two steps, "a" then "b", against a fake
// provider (which honours Idempotency-Key or not, drawn per sequence), then
// answers 201 with both results. Each request draws a plan: for each step its
// policy (StepRerun or StepRefuse) and what its function does if it runs —
// succeeds, fails for good (StepFinal: a decline), fails transiently (a 503
// before the provider acted), fails ambiguously (StepAmbiguous, after the
// provider acted), crashes before the provider call, or crashes after the
// provider acted — and whether the handler crashes after both steps, before
// the answer is stored. The handler answers a final failure 402 (kept), an
// unknown step 503 (the outcome marked unknown) and other step errors 502 (not
// kept: the key is released).
//
// Actions: request; hold (a request whose handler blocks between its steps)
// and release (it goes on: when its claim was taken over meanwhile, its next
// Step is refused with ErrLockLost and nothing changes); advance (past the
// lease, so a held or unknown request's key is taken over; past the TTL, so
// the key is a new operation with new derived keys).
//
// Invariants, after every step: every answer is the predicted one; the
// provider saw exactly the predicted calls, with the predicted derived keys
// (stable across retries and takeovers, new after the TTL) and the predicted
// effects — with a provider that honours keys, at most one effect per
// derived key, whatever crashed where; a step recorded done is never run again;
// the store's step records (GetSteps) are the model's.
//
//	go test -run 'TestModelSteps' -rapid.checks=20000 -rapid.steps=40 -timeout 1h .

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
)

func TestModelStepsMemstore(t *testing.T) {
	t.Parallel()
	budget := modelBudget()
	if budget > 0 {
		budget = 16
	}
	rapid.Check(t, func(rt *rapid.T) {
		s := memstore.New(&memstore.Config{JanitorInterval: -1})
		defer s.Close()
		runStepModel(rt, s, stepModelRun{budget: budget, flow: idem.FlowClaimComplete, hold: true})
	})
}

// TestModelStepsSQLite runs the step model on SQLite, in both flows, once
// sqlitestore keeps step records (idem.StepStore); without holds, since a
// held handler's transaction would hold SQLite's one write lock.
func TestModelStepsSQLite(t *testing.T) {
	t.Parallel()
	if _, ok := any((*sqlitestore.Store)(nil)).(idem.StepStore); !ok {
		t.Skip("sqlitestore keeps no step records yet (it is no idem.StepStore): the step model runs on memstore only")
	}
	newTarget := sqliteModel(t)
	budget := modelBudget()
	if budget > 0 {
		budget = 16
	}
	rapid.Check(t, func(rt *rapid.T) {
		tg := newTarget(rt)
		ss := any(tg.store).(stepModelStore)
		flow := rapid.SampledFrom([]idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx}).Draw(rt, "flow")
		runStepModel(rt, ss, stepModelRun{budget: budget, flow: flow})
	})
}

var smSteps = []string{"a", "b"}

// smPlan is what one request's handler does.
type smPlan struct {
	Out   [2]string // per step: ok, final, transient, ambiguous, crash-before, crash-inside
	Pol   [2]string // per step: rerun, refuse
	Crash bool      // the handler crashes after both steps
	Hold  bool      // the handler blocks between its steps until released
}

func (p smPlan) String() string {
	s := fmt.Sprintf("a=%s/%s b=%s/%s", p.Out[0], p.Pol[0], p.Out[1], p.Pol[1])
	if p.Crash {
		s += " crash-after"
	}
	if p.Hold {
		s += " hold"
	}
	return s
}

// smStep is the model of one step record.
type smStep struct {
	name    string
	state   string // started, abandoned, done, failed
	derived string // learned from the store after the action that wrote the record
	expires time.Time
	owner   int  // the execution that began it (started); 0 once that execution ended
	called  bool // the provider was called with its derived key
}

func (st *smStep) result() string {
	if st.derived == "" {
		return "r-?"
	}
	return "r-" + st.derived[5:11]
}

// smRec is the model of the key's request record.
type smRec struct {
	state   string // "" (absent), inflight, complete
	holder  int    // the execution holding it (inflight)
	lease   time.Time
	expires time.Time
	status  int
	body    func() string
}

// smWant is a predicted answer: status and body (status 0: no answer, the
// handler crashed; body nil: any).
type smWant struct {
	status int
	body   func() string
}

func fixed(s string) func() string { return func() string { return s } }

// smPred is a predicted provider call.
type smPred struct {
	step   *smStep
	effect bool
}

type smHarness struct {
	t       *rapid.T
	store   stepModelStore
	clock   modelClock
	honours bool
	srv     *httptest.Server
	client  *http.Client
	step    int
	ttl     time.Duration
	key     string

	mu      sync.Mutex
	calls   []smCall // the provider's log
	held    *smHeld
	nextExe int

	rec     smRec
	steps   map[string]*smStep
	preds   []smPred // predicted provider calls, in order
	answers []smAnswer
	keys    map[string]bool // every derived key seen
}

type smAnswer struct {
	what string
	got  result
	want smWant
}

type smCall struct {
	key    string
	effect bool
}

type smHeld struct {
	done    []*smStep // the steps it passed before the hold
	start   time.Time
	exe     int
	plan    smPlan
	at      chan struct{} // closed when the handler reached the hold
	release chan struct{}
	res     chan result
}

// smKeys numbers the keys of the step model's sequences: the step records
// of a store shared by several sequences (SQLite's) are not emptied between
// them.
var smKeys atomic.Int64

// stepModelStore is a store the step model runs on.
type stepModelStore interface {
	idem.Store
	idem.StepStore
}

// stepModelRun is what one run of the step model may do.
type stepModelRun struct {
	budget int       // the most actions of a sequence; 0: no bound
	flow   idem.Flow // FlowClaimComplete or FlowSingleTx
	hold   bool      // requests may be held between their steps (stores whose transactions do not serialize every write)
}

func runStepModel(t *rapid.T, store stepModelStore, run stepModelRun) {
	budget := run.budget
	h := &smHarness{t: t, store: store, key: fmt.Sprintf("order-%d", smKeys.Add(1)), honours: rapid.Bool().Draw(t, "honours"), ttl: 4 * modelLease,
		steps: map[string]*smStep{}, keys: map[string]bool{}}
	h.clock.set(time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC))
	mw, err := idem.New(store, &idem.Config{Lease: modelLease, TTL: h.ttl, NowFunc: h.clock.Now, Flow: run.flow,
		KeepFunc: func(s int) bool { return s < 500 }})
	if err != nil {
		t.Fatal(err)
	}
	h.srv = httptest.NewServer(mw(http.HandlerFunc(h.business)))
	h.client = &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 20 * time.Second}
	t.Cleanup(func() {
		h.mu.Lock()
		held := h.held
		h.mu.Unlock()
		if held != nil {
			close(held.release)
			select {
			case <-held.res:
			case <-time.After(20 * time.Second):
			}
		}
		h.srv.Close()
	})
	t.Logf("step 0: provider honours keys: %v, lease %v, TTL %v, %v flow", h.honours, modelLease, h.ttl, run.flow)
	act := func(f func(*rapid.T)) func(*rapid.T) {
		return func(t *rapid.T) {
			if budget == 0 || h.step < budget {
				h.step++
				f(t)
				h.check(t)
			}
		}
	}
	actions := map[string]func(*rapid.T){
		"request": act(h.actRequest),
		"advance": act(h.actAdvance),
	}
	if run.hold {
		actions["hold"], actions["release"] = act(h.actHold), act(h.actRelease)
	}
	t.Repeat(actions)
}

var (
	errSMTransient = errors.New("provider: 503")
	errSMTimeout   = errors.New("provider: timeout")
	errSMDecline   = errors.New("card declined")
)

// provider is the fake service: it acts (an effect) unless it honours keys
// and saw the key before.
func (h *smHarness) provider(key string) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	seen := slices.ContainsFunc(h.calls, func(c smCall) bool { return c.key == key })
	h.calls = append(h.calls, smCall{key: key, effect: !(h.honours && seen)})
	return "r-" + key[5:11]
}

func (h *smHarness) business(w http.ResponseWriter, r *http.Request) {
	var plan smPlan
	_ = json.Unmarshal([]byte(r.Header.Get("X-Plan")), &plan)
	_, _ = io.Copy(io.Discard, r.Body)
	var results []string
	for i, name := range smSteps {
		if i == 1 && plan.Hold {
			h.mu.Lock()
			held := h.held
			h.mu.Unlock()
			close(held.at)
			<-held.release
		}
		pol := idem.StepRerun
		if plan.Pol[i] == "refuse" {
			pol = idem.StepRefuse
		}
		out := plan.Out[i]
		res, err := idem.Step(r.Context(), name, func(ctx context.Context, key string) (string, error) {
			switch out {
			case "crash-before":
				panic(http.ErrAbortHandler)
			case "transient":
				return "", errSMTransient
			}
			v := h.provider(key)
			switch out {
			case "final":
				return "", idem.StepFinal(errSMDecline)
			case "ambiguous":
				return "", idem.StepAmbiguous(errSMTimeout)
			case "crash-inside":
				panic(http.ErrAbortHandler)
			}
			return v, nil
		}, idem.OnUnknown(pol))
		switch {
		case errors.Is(err, idem.ErrStepFailed):
			w.WriteHeader(http.StatusPaymentRequired)
			_, _ = fmt.Fprintf(w, "step %s failed", name)
			return
		case errors.Is(err, idem.ErrStepUnknown):
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = fmt.Fprintf(w, "step %s unknown", name)
			return
		case errors.Is(err, idem.ErrLockLost):
			w.WriteHeader(http.StatusGone)
			_, _ = fmt.Fprintf(w, "step %s: lock lost", name)
			return
		case err != nil:
			w.WriteHeader(http.StatusBadGateway)
			_, _ = fmt.Fprintf(w, "step %s: %v", name, err)
			return
		}
		results = append(results, name+"="+res)
	}
	if plan.Crash {
		panic(http.ErrAbortHandler)
	}
	w.WriteHeader(http.StatusCreated)
	_, _ = io.WriteString(w, strings.Join(results, ","))
}

func (h *smHarness) drawPlan(t *rapid.T) smPlan {
	var p smPlan
	outs := []string{"ok", "ok", "ok", "final", "transient", "ambiguous", "crash-before", "crash-inside"}
	for i := range p.Out {
		p.Out[i] = rapid.SampledFrom(outs).Draw(t, fmt.Sprintf("out%d", i))
		p.Pol[i] = rapid.SampledFrom([]string{"rerun", "refuse"}).Draw(t, fmt.Sprintf("pol%d", i))
	}
	p.Crash = rapid.IntRange(0, 4).Draw(t, "crash") == 0
	return p
}

func (h *smHarness) send(plan smPlan) result {
	b, _ := json.Marshal(plan)
	req, _ := http.NewRequest(http.MethodPost, h.srv.URL+"/orders", strings.NewReader(`{"cart":"c1"}`))
	req.Header.Set("Idempotency-Key", h.key)
	req.Header.Set("X-Plan", string(b))
	resp, err := h.client.Do(req)
	if err != nil {
		return result{err: err}
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return result{err: err}
	}
	return result{a: &answer{resp.StatusCode, resp.Header, body}}
}

// expire drops the step records the clock has expired. An expired request
// record stays in the model: its holder can still complete or release it
// (the fence compares tokens), and a new claim replaces it.
func (h *smHarness) expire(now time.Time) {
	for name, st := range h.steps {
		if !st.expires.After(now) {
			delete(h.steps, name)
		}
	}
}

// admit predicts what the middleware does with a new request before its
// handler: replay, 409, or run it (a claim or a takeover); exe numbers the
// execution.
func (h *smHarness) admit(now time.Time) (want smWant, run bool, exe int) {
	h.expire(now)
	if h.rec.state != "" && !h.rec.expires.After(now) {
		h.rec = smRec{} // expired: absent for a claim
	}
	switch h.rec.state {
	case "complete":
		return smWant{h.rec.status, h.rec.body}, false, 0
	case "inflight":
		if h.rec.lease.After(now) {
			return smWant{status: http.StatusConflict}, false, 0
		}
	}
	takeover := h.rec.state == "inflight" // its lease lapsed
	h.nextExe++
	exe = h.nextExe
	h.rec = smRec{state: "inflight", holder: exe, lease: now.Add(modelLease), expires: now.Add(h.ttl)}
	if takeover {
		// A takeover moves the expiry of every live step record to its own,
		// before its handler runs (the steps live as long as the operation).
		for _, st := range h.steps {
			st.expires = maxTime(st.expires, h.opExpiry(exe))
		}
	}
	return smWant{}, true, exe
}

// runSteps predicts execution exe's handler from step `from` on, at now; held
// is true when it stops at the hold before step b.
func (h *smHarness) runSteps(plan smPlan, exe int, now time.Time, from int, holdable bool, done *[]*smStep) (want smWant, held bool) {
	for i := from; i < len(smSteps); i++ {
		name := smSteps[i]
		if i == 1 && holdable && plan.Hold {
			return smWant{}, true
		}
		if h.rec.state != "inflight" || h.rec.holder != exe || !h.rec.expires.After(now) {
			// Taken over, released, or expired: ErrLockLost, and the handler
			// answers 410. Its completion is fenced by the token alone: it
			// stores the 410 over an expired record still held under exe's
			// token, and changes nothing otherwise.
			want := smWant{http.StatusGone, fixed(fmt.Sprintf("step %s: lock lost", name))}
			if h.rec.state == "inflight" && h.rec.holder == exe {
				return h.settle(want.status, want.body, now), false
			}
			h.endExecution(exe)
			return want, false
		}
		st := h.steps[name]
		if st != nil {
			st.expires = maxTime(st.expires, h.opExpiry(exe))
		}
		switch {
		case st != nil && st.state == "done":
			*done = append(*done, st)
			continue
		case st != nil && st.state == "failed":
			return h.settle(http.StatusPaymentRequired, fixed(fmt.Sprintf("step %s failed", name)), now), false
		case st != nil && st.state == "started" && st.owner != exe && plan.Pol[i] == "refuse":
			// Unknown (MarkOutcomeUnknown): the answer is sent, nothing is
			// kept, and the record stays in flight until its lease lapses.
			h.endExecution(exe)
			return smWant{http.StatusServiceUnavailable, fixed(fmt.Sprintf("step %s unknown", name))}, false
		case st == nil:
			st = &smStep{name: name, expires: h.opExpiry(exe)}
			h.steps[name] = st
		}
		st.state, st.owner = "started", exe
		call := func() {
			h.preds = append(h.preds, smPred{step: st, effect: !h.honours || !st.called})
			st.called = true
		}
		switch plan.Out[i] {
		case "crash-before":
			return h.release(exe), false
		case "transient":
			st.state, st.owner = "abandoned", 0
			h.release(exe)
			return smWant{http.StatusBadGateway, fixed(fmt.Sprintf("step %s: %v", name, errSMTransient))}, false
		case "final":
			call()
			st.state = "failed"
			return h.settle(http.StatusPaymentRequired, fixed(fmt.Sprintf("step %s failed", name)), now), false
		case "ambiguous":
			call()
			h.release(exe)
			return smWant{http.StatusBadGateway, fixed(fmt.Sprintf("step %s: %v", name, errSMTimeout))}, false
		case "crash-inside":
			call()
			return h.release(exe), false
		}
		call()
		st.state = "done"
		*done = append(*done, st)
	}
	if plan.Crash {
		return h.release(exe), false
	}
	body := func() string {
		var parts []string
		for _, st := range *done {
			parts = append(parts, st.name+"="+st.result())
		}
		return strings.Join(parts, ",")
	}
	return h.settle(http.StatusCreated, body, now), false
}

// opExpiry is the expiry of the steps execution exe writes: its request's
// start plus the TTL (the model's clock is the same for the whole action, and
// a held execution started at its hold action).
func (h *smHarness) opExpiry(exe int) time.Time {
	if h.held != nil && h.held.exe == exe {
		return h.held.start.Add(h.ttl)
	}
	return h.clock.Now().Add(h.ttl)
}

// endExecution: exe's steps are no longer its own once it ended.
func (h *smHarness) endExecution(exe int) {
	for _, st := range h.steps {
		if st.state == "started" && st.owner == exe {
			st.owner = 0
		}
	}
}

// release: the execution ended without an outcome (a crash, an answer not
// kept): the key is released when it still held it.
func (h *smHarness) release(exe int) smWant {
	if h.rec.state == "inflight" && h.rec.holder == exe {
		h.rec = smRec{}
	}
	h.endExecution(exe)
	return smWant{}
}

func (h *smHarness) settle(status int, body func() string, now time.Time) smWant {
	h.rec = smRec{state: "complete", status: status, body: body, expires: now.Add(h.ttl)}
	for _, st := range h.steps {
		if st.state == "started" {
			st.owner = 0
		}
	}
	return smWant{status, body}
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func (h *smHarness) actRequest(t *rapid.T) {
	plan := h.drawPlan(t)
	now := h.clock.Now()
	t.Logf("step %d: request %s", h.step, plan)
	want, run, exe := h.admit(now)
	if run {
		want, _ = h.runSteps(plan, exe, now, 0, false, new([]*smStep))
	}
	h.answers = append(h.answers, smAnswer{"request " + plan.String(), h.send(plan), want})
}

func (h *smHarness) actHold(t *rapid.T) {
	if h.held != nil {
		t.Skip("a request is held already")
	}
	plan := h.drawPlan(t)
	plan.Hold = true
	now := h.clock.Now()
	t.Logf("step %d: hold %s", h.step, plan)
	want, run, exe := h.admit(now)
	hr := &smHeld{exe: exe, plan: plan, start: now, at: make(chan struct{}), release: make(chan struct{}), res: make(chan result, 1)}
	held := false
	if run {
		h.mu.Lock()
		h.held = hr
		h.mu.Unlock()
		want, held = h.runSteps(plan, exe, now, 0, true, &hr.done)
	}
	if !held {
		h.mu.Lock()
		h.held = nil
		h.mu.Unlock()
		plan.Hold = false // it never reaches the hold
		h.answers = append(h.answers, smAnswer{"hold " + plan.String(), h.send(plan), want})
		return
	}
	go func() { hr.res <- h.send(plan) }()
	select {
	case <-hr.at:
	case res := <-hr.res:
		h.mu.Lock()
		h.held = nil
		h.mu.Unlock()
		t.Fatalf("the held request was answered before it reached the hold: %+v %v", res.a, res.err)
	case <-time.After(10 * time.Second):
		t.Fatal("the held request never reached the hold")
	}
}

func (h *smHarness) actRelease(t *rapid.T) {
	hr := h.held
	if hr == nil {
		t.Skip("no request is held")
	}
	now := h.clock.Now()
	t.Logf("step %d: release the held request (execution %d)", h.step, hr.exe)
	h.expire(now)
	want, _ := h.runSteps(hr.plan, hr.exe, now, 1, false, &hr.done)
	close(hr.release)
	res := <-hr.res
	h.mu.Lock()
	h.held = nil
	h.mu.Unlock()
	h.answers = append(h.answers, smAnswer{"release", res, want})
}

func (h *smHarness) actAdvance(t *rapid.T) {
	d := rapid.SampledFrom([]time.Duration{time.Second, modelLease + time.Second, 4*modelLease + time.Second}).Draw(t, "by")
	t.Logf("step %d: advance %v", h.step, d)
	h.clock.set(h.clock.Now().Add(d))
}

// check learns the derived keys of new step records from the store, then
// compares the store's steps, the answers and the provider's calls with the
// model.
func (h *smHarness) check(t *rapid.T) {
	now := h.clock.Now()
	h.expire(now)
	recs, err := h.store.GetSteps(context.Background(), idem.StoredScope(""), h.key, now)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]idem.StepRecord{}
	for _, r := range recs {
		got[r.Name] = r
	}
	for name, st := range h.steps {
		r, ok := got[name]
		if !ok {
			t.Fatalf("the model has step %s (%s), the store none", name, st.state)
		}
		if st.derived == "" {
			if h.keys[r.DerivedKey] {
				t.Fatalf("step %s's new record reuses derived key %s of an earlier record", name, r.DerivedKey)
			}
			st.derived = r.DerivedKey
			h.keys[r.DerivedKey] = true
		}
		want := map[string]idem.StepState{"started": idem.StepStarted, "abandoned": idem.StepStarted, "done": idem.StepDone, "failed": idem.StepFailed}[st.state]
		if r.State != want || r.DerivedKey != st.derived || (st.state == "abandoned") != (r.Owner == "") && st.state != "done" && st.state != "failed" {
			t.Fatalf("step %s: the store has %v owner=%q key=%s, the model %s key=%s", name, r.State, r.Owner, r.DerivedKey, st.state, st.derived)
		}
		if !r.ExpiresAt.Equal(st.expires) {
			t.Fatalf("step %s expires at %v in the store, %v in the model", name, r.ExpiresAt, st.expires)
		}
		if st.state == "done" && string(r.Result) != fmt.Sprintf("%q", st.result()) {
			t.Fatalf("step %s's recorded result %s, want %q", name, r.Result, st.result())
		}
	}
	for name := range got {
		if h.steps[name] == nil {
			t.Fatalf("the store has step %s (%+v), the model none", name, got[name])
		}
	}
	for _, a := range h.answers {
		h.expect(a)
	}
	h.answers = h.answers[:0]
	h.mu.Lock()
	calls := append([]smCall(nil), h.calls...)
	h.mu.Unlock()
	if len(calls) != len(h.preds) {
		t.Fatalf("the provider saw %d calls, the model predicts %d", len(calls), len(h.preds))
	}
	effects := map[string]int{}
	for i, c := range calls {
		p := h.preds[i]
		if c.key != p.step.derived || c.effect != p.effect {
			t.Fatalf("provider call %d: key %s (effect %v); the model: step %s key %s (effect %v)", i, c.key, c.effect, p.step.name, p.step.derived, p.effect)
		}
		if c.effect {
			effects[c.key]++
		}
	}
	if h.honours {
		for k, n := range effects {
			if n > 1 {
				t.Fatalf("a provider that honours keys acted %d times for key %s", n, k)
			}
		}
	}
}

func (h *smHarness) expect(a smAnswer) {
	t := h.t
	want := a.want
	if want.status == 0 {
		if a.got.err == nil {
			t.Fatalf("%s: want no answer (the handler crashed), got %d %s", a.what, a.got.a.status, a.got.a.body)
		}
		return
	}
	if a.got.err != nil {
		t.Fatalf("%s: want %d, got no answer: %v", a.what, want.status, a.got.err)
	}
	if a.got.a.status != want.status {
		t.Fatalf("%s: want %d, got %d %s", a.what, want.status, a.got.a.status, a.got.a.body)
	}
	if want.body != nil && string(a.got.a.body) != want.body() {
		t.Fatalf("%s: want %d %q, got %q", a.what, want.status, want.body(), a.got.a.body)
	}
}

// Planted bugs in the step records the model must catch: the planted store
// is memstore with one step method broken.
type plantedSteps struct {
	*memstore.Store
	bug string
}

func (p plantedSteps) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	switch p.bug {
	case "holder ignored":
		req.Holder = false
	case "rerun always":
		req.Rerun = true
	}
	rec, began, err := p.Store.BeginStep(ctx, req)
	if p.bug == "new key every run" && err == nil && began {
		c := *rec
		c.DerivedKey = req.DerivedKey
		return &c, began, nil
	}
	return rec, began, err
}

func (p plantedSteps) FinishStep(ctx context.Context, scope, key, name, owner string, st idem.StepState, result []byte, now time.Time) error {
	if p.bug == "finish forgets" {
		return nil // reports the step recorded, records nothing
	}
	return p.Store.FinishStep(ctx, scope, key, name, owner, st, result, now)
}

func TestModelStepsCatchesPlantedBugs(t *testing.T) {
	// Not parallel: it sets rapid's flags, as TestModelCatchesPlantedBugs does.
	for name, value := range map[string]string{"rapid.nofailfile": "true", "rapid.shrinktime": "10s"} {
		old := flag.Lookup(name).Value.String()
		if err := flag.Set(name, value); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = flag.Set(name, old) })
	}
	for _, bug := range []string{"", "holder ignored", "rerun always", "new key every run", "finish forgets"} {
		tb := &captureTB{name: "planted/" + bug}
		rapid.Check(tb, func(rt *rapid.T) {
			s := memstore.New(&memstore.Config{JanitorInterval: -1})
			defer s.Close()
			runStepModel(rt, plantedSteps{s, bug}, stepModelRun{budget: 2 * 16, flow: idem.FlowClaimComplete, hold: true})
		})
		switch {
		case bug == "" && tb.Failed():
			t.Errorf("the step model failed on memstore:\n%s", tb.output())
		case bug != "" && !tb.Failed():
			t.Errorf("%s: the step model did not catch the planted bug", bug)
		case bug != "":
			t.Logf("%s: caught:\n%s", bug, stepCounterexample(tb.output()))
		}
	}
}

// stepCounterexample keeps the failure and the steps of rapid's output.
func stepCounterexample(out string) string {
	var b strings.Builder
	for line := range strings.SplitSeq(out, "\n") {
		if strings.Contains(line, "step ") || strings.Contains(line, "FAIL") || strings.Contains(line, "failed after") {
			b.WriteString(line)
			b.WriteByte('\n')
		}
	}
	return b.String()
}

// TestModelStepsSingleTx runs the step model in the single-transaction flow
// on memstore behind a locking fake (lockedMem), without holds: the flow's
// step records are not fenced on a record (none is committed while the
// handler runs) and its crashes roll everything back.
func TestModelStepsSingleTx(t *testing.T) {
	t.Parallel()
	budget := modelBudget()
	if budget > 0 {
		budget = 16
	}
	rapid.Check(t, func(rt *rapid.T) {
		s := memstore.New(&memstore.Config{JanitorInterval: -1})
		defer s.Close()
		runStepModel(rt, &lockedMem{Store: s, locked: map[string]bool{}}, stepModelRun{budget: budget, flow: idem.FlowSingleTx})
	})
}

// lockedMem is memstore as an idem.SingleTxStore: BeginLocked takes a per-key
// lock, and the inserted record is written at Commit (a claim and its
// completion).
type lockedMem struct {
	*memstore.Store
	mu     sync.Mutex
	locked map[string]bool
}

type lockedMemTx struct {
	s    *lockedMem
	id   string
	rec  *idem.Record
	done bool
}

func (s *lockedMem) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	id := scope + "\x00" + key
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.locked[id] {
		return nil, nil, nil, idem.ErrInFlight
	}
	rec, err := s.Get(ctx, scope, key, now)
	if errors.Is(err, idem.ErrNotFound) {
		rec, err = nil, nil
	}
	if err != nil {
		return nil, nil, nil, err
	}
	s.locked[id] = true
	return ctx, &lockedMemTx{s: s, id: id}, rec, nil
}

func (tx *lockedMemTx) Insert(_ context.Context, rec *idem.Record) error {
	c := *rec
	resp := *rec.Response
	resp.Body = append([]byte(nil), resp.Body...)
	c.Response = &resp
	tx.rec = &c
	return nil
}

func (tx *lockedMemTx) Commit(ctx context.Context) error {
	if tx.done {
		return nil
	}
	defer tx.end()
	if r := tx.rec; r != nil {
		if _, ok, err := tx.s.Claim(ctx, idem.ClaimRequest{Scope: r.Scope, Key: r.Key, Fingerprint: r.Fingerprint, Token: r.Token, Now: r.CreatedAt, LeaseUntil: r.LeaseUntil, ExpiresAt: r.ExpiresAt}); err != nil || !ok {
			return errors.Join(idem.ErrInFlight, err)
		}
		return tx.s.Complete(ctx, r.Scope, r.Key, r.Token, r.Response, r.LeaseUntil, r.ExpiresAt)
	}
	return nil
}

func (tx *lockedMemTx) Rollback(context.Context) error {
	if !tx.done {
		tx.end()
	}
	return nil
}

func (tx *lockedMemTx) end() {
	tx.done = true
	tx.s.mu.Lock()
	delete(tx.s.locked, tx.id)
	tx.s.mu.Unlock()
}
