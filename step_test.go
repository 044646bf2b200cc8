package idem_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// Unit tests of Step in the middleware, with memstore's step records and an
// in-memory provider; the real stores and real crashes (SIGKILL) are proved
// elsewhere (storetest's step cases, the demo's kill tests).

// provider is a fake payment service: it counts its calls by the
// Idempotency-Key they carry, and the charges it made.
type provider struct {
	mu      sync.Mutex
	calls   map[string]int
	charges int
	honours bool // it replays the first answer to a key it saw
}

func newProvider(honours bool) *provider { return &provider{calls: map[string]int{}, honours: honours} }

func (p *provider) charge(key string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.calls[key]++
	if p.honours && p.calls[key] > 1 {
		return "ch_" + key[5:13]
	}
	p.charges++
	return "ch_" + key[5:13]
}

func (p *provider) total() (calls, charges int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.calls {
		calls += n
	}
	return calls, p.charges
}

type charge struct {
	ID     string `json:"id"`
	Amount int    `json:"amount"`
}

func newClock() *clock { return &clock{now: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)} }

// crashPost sends a request whose handler crashes (panics with
// http.ErrAbortHandler): the connection is cut, and the answer is zero.
func crashPost(t *testing.T, srv *httptest.Server, key string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"book"}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		return answer{}
	}
	defer resp.Body.Close()
	return answer{status: resp.StatusCode, header: resp.Header}
}

// stepSrv is a test server whose handler runs under mu, so that the test
// reads what handlers wrote once it took mu after an answer (post, crash).
type stepSrv struct {
	*httptest.Server
	mu sync.Mutex
}

func (s *stepSrv) post(t *testing.T, key string) answer {
	t.Helper()
	a := postAnswer(t, s.Server, key)
	s.mu.Lock()
	defer s.mu.Unlock()
	return a
}

func (s *stepSrv) crash(t *testing.T, key string) answer {
	t.Helper()
	a := crashPost(t, s.Server, key)
	s.mu.Lock()
	defer s.mu.Unlock()
	return a
}

// stepServer serves handler under idem with store and cfg on a loopback
// socket, one request at a time.
func stepServer(t *testing.T, store idem.Store, cfg idem.Config, handler http.HandlerFunc) *stepSrv {
	t.Helper()
	mw, err := idem.New(store, &cfg)
	if err != nil {
		t.Fatal(err)
	}
	s := &stepSrv{}
	s.Server = serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.mu.Lock()
		defer s.mu.Unlock()
		handler(w, r)
	})))
	return s
}

func stepMem(t *testing.T) *memstore.Store {
	s := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// stepsOf returns the live step records of (scope "", key).
func stepsOf(t *testing.T, s idem.StepStore, key string, now time.Time) map[string]idem.StepRecord {
	t.Helper()
	recs, err := s.GetSteps(context.Background(), idem.StoredScope(""), key, now)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]idem.StepRecord{}
	for _, r := range recs {
		m[r.Name] = r
	}
	return m
}

// chargeStep is the step the tests' handlers run.
func chargeStep(p *provider) func(ctx context.Context, key string) (charge, error) {
	return func(ctx context.Context, key string) (charge, error) {
		return charge{ID: p.charge(key), Amount: 1250}, nil
	}
}

// A handler that crashes after its step was recorded and before its outcome
// was stored (a panic here; a SIGKILL in the demo's proof): the retry gets the
// recorded charge without calling the provider again — the recovery point —
// and its answer carries that charge.
func TestStepRecoveryPointAfterCrash(t *testing.T) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			mem := stepMem(t)
			var store idem.Store = mem
			if flow == idem.FlowSingleTx {
				store = newFakeSingleTx(mem)
			}
			clk := newClock()
			p := newProvider(false)
			var crash sync.Once
			var runs int
			srv := stepServer(t, store, idem.Config{NowFunc: clk.Now, Flow: flow}, func(w http.ResponseWriter, r *http.Request) {
				runs++
				ch, err := idem.Step(r.Context(), "charge", chargeStep(p))
				if err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				crashed := false
				crash.Do(func() { crashed = true })
				if crashed {
					panic(http.ErrAbortHandler) // killed between the recorded charge and the commit
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = fmt.Fprintf(w, `{"charge_id":%q}`, ch.ID)
			})
			if a := srv.crash(t, "order-1"); a.status != 0 {
				t.Fatalf("the crashed request was answered %d %s", a.status, a.body)
			}
			a := srv.post(t, "order-1")
			calls, charges := p.total()
			if a.status != http.StatusCreated || runs != 2 || calls != 1 || charges != 1 {
				t.Fatalf("retry after the crash: %d %s; handler runs %d, provider calls %d, charges %d; want 201, 2 runs, 1 call, 1 charge", a.status, a.body, runs, calls, charges)
			}
			steps := stepsOf(t, mem, "order-1", clk.Now())
			if st := steps["charge"]; st.State != idem.StepDone || !strings.Contains(string(a.body), "ch_"+st.DerivedKey[5:13]) {
				t.Fatalf("the answer %s does not carry the recorded charge %+v", a.body, st)
			}
			// A replay does not run the handler, nor Step.
			if b := srv.post(t, "order-1"); b.status != http.StatusCreated || string(b.body) != string(a.body) || runs != 2 {
				t.Fatalf("replay: %d %s, runs %d", b.status, b.body, runs)
			}
			if calls, _ := p.total(); calls != 1 {
				t.Fatalf("the provider was called %d times, want 1", calls)
			}
		})
	}
}

// A crash inside the step, after the provider acted and before its answer was
// recorded: by default the retry runs the step again with the same derived key
// (a provider that honours it replays: one charge); with OnUnknown(StepRefuse)
// the retry does not call the provider again, gets ErrStepUnknown, and the
// key's outcome is unknown (in flight: 409 for the next request).
func TestStepUnknownRerunOrRefuse(t *testing.T) {
	for _, c := range []struct {
		flow   idem.Flow
		policy idem.UnknownPolicy
	}{{idem.FlowClaimComplete, idem.StepRerun}, {idem.FlowClaimComplete, idem.StepRefuse}, {idem.FlowSingleTx, idem.StepRerun}, {idem.FlowSingleTx, idem.StepRefuse}} {
		policy := c.policy
		t.Run(c.flow.String()+"/"+policy.String(), func(t *testing.T) {
			t.Parallel()
			mem := stepMem(t)
			var store idem.Store = mem
			if c.flow == idem.FlowSingleTx {
				store = newFakeSingleTx(mem)
			}
			clk := newClock()
			p := newProvider(true)
			var crash sync.Once
			var keys []string
			var mu sync.Mutex
			srv := stepServer(t, store, idem.Config{NowFunc: clk.Now, Flow: c.flow}, func(w http.ResponseWriter, r *http.Request) {
				ch, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (charge, error) {
					mu.Lock()
					keys = append(keys, key)
					mu.Unlock()
					c := charge{ID: p.charge(key)}
					crash.Do(func() { panic(http.ErrAbortHandler) }) // the provider charged; the process died before the record
					return c, nil
				}, idem.OnUnknown(policy))
				if errors.Is(err, idem.ErrStepUnknown) {
					http.Error(w, err.Error(), http.StatusServiceUnavailable)
					return
				}
				if err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = fmt.Fprintf(w, `{"charge_id":%q}`, ch.ID)
			})
			srv.crash(t, "order-1")
			a := srv.post(t, "order-1")
			calls, charges := p.total()
			if policy == idem.StepRerun {
				if a.status != http.StatusCreated || calls != 2 || charges != 1 || len(keys) != 2 || keys[0] != keys[1] {
					t.Fatalf("rerun: %d %s; provider calls %d, charges %d, keys %v; want 201, the step run again with the same key, one charge", a.status, a.body, calls, charges, keys)
				}
				return
			}
			if a.status != http.StatusServiceUnavailable || calls != 1 || !strings.Contains(string(a.body), "idem resolve --step charge") {
				t.Fatalf("refuse: %d %s; provider calls %d; want 503 naming idem resolve, the provider not called again", a.status, a.body, calls)
			}
			if b := srv.post(t, "order-1"); b.status != http.StatusConflict {
				t.Fatalf("after a refused unknown step the next request got %d %s, want 409 (the outcome is unknown, the key in flight)", b.status, b.body)
			}
			// An operator settles the step; once the lease lapses the retry carries on.
			if err := mem.SettleStep(context.Background(), idem.StoredScope(""), "order-1", "charge", idem.StepDone, []byte(`{"id":"ch_settled"}`), clk.Now()); err != nil {
				t.Fatal(err)
			}
			clk.Add(idem.DefaultLease + time.Second)
			if c := srv.post(t, "order-1"); c.status != http.StatusCreated || !strings.Contains(string(c.body), "ch_settled") {
				t.Fatalf("after SettleStep: %d %s, want 201 with the settled charge", c.status, c.body)
			}
			if calls, _ := p.total(); calls != 1 {
				t.Fatalf("the provider was called %d times, want 1", calls)
			}
		})
	}
}

var errDeclined = errors.New("card declined")

// A final failure (StepFinal) is recorded and replayed without running the step
// again; on the first run the error wraps the step's own. A transient failure
// is not recorded: the retry runs the step again with the same derived key,
// under StepRefuse too.
func TestStepFinalAndTransientFailures(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	clk := newClock()
	var mu sync.Mutex
	calls := map[string][]string{}
	var firstErr, laterErr error
	srv := stepServer(t, mem, idem.Config{NowFunc: clk.Now, KeepFunc: func(s int) bool { return s < 500 }}, func(w http.ResponseWriter, r *http.Request) {
		order := r.Header.Get("Idempotency-Key")
		_, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (charge, error) {
			mu.Lock()
			calls[order] = append(calls[order], key)
			n := len(calls[order])
			mu.Unlock()
			if order == "declined" {
				return charge{}, StepFinalOf(errDeclined)
			}
			if n == 1 {
				return charge{}, errProvider503
			}
			return charge{ID: "ch_ok"}, nil
		}, idem.OnUnknown(idem.StepRefuse))
		mu.Lock()
		if order == "declined" {
			if firstErr == nil {
				firstErr = err
			} else {
				laterErr = err
			}
		}
		mu.Unlock()
		switch {
		case errors.Is(err, idem.ErrStepFailed):
			http.Error(w, err.Error(), http.StatusPaymentRequired)
			panic(http.ErrAbortHandler) // crash after the recorded decline, so that the retry reaches Step
		case errors.Is(err, errProvider503):
			http.Error(w, err.Error(), http.StatusBadGateway)
		case err != nil:
			http.Error(w, "unexpected: "+err.Error(), http.StatusInternalServerError)
		default:
			w.WriteHeader(http.StatusCreated)
		}
	})
	srv.crash(t, "declined")
	srv.crash(t, "declined")
	var sfe *idem.StepFailedError
	if !errors.Is(firstErr, errDeclined) || !errors.As(firstErr, &sfe) || sfe.Step != "charge" || sfe.Message != "charge: card declined" {
		t.Fatalf("first run's error = %v, want a *StepFailedError wrapping errDeclined", firstErr)
	}
	if !errors.Is(laterErr, idem.ErrStepFailed) || !errors.As(laterErr, &sfe) || sfe.Message != "charge: card declined" || errors.Is(laterErr, errDeclined) {
		t.Fatalf("the retry's error = %v, want the recorded failure (message only)", laterErr)
	}
	if n := len(calls["declined"]); n != 1 {
		t.Fatalf("the declined step ran %d times, want 1", n)
	}

	if a := srv.post(t, "flaky"); a.status != http.StatusBadGateway {
		t.Fatalf("transient failure: %d %s, want 502", a.status, a.body)
	}
	if st := stepsOf(t, mem, "flaky", clk.Now())["charge"]; st.State != idem.StepStarted || st.Owner != "" {
		t.Fatalf("after a transient failure the step is %+v, want started without owner (abandoned)", st)
	}
	if a := srv.post(t, "flaky"); a.status != http.StatusCreated {
		t.Fatalf("retry after a transient failure (StepRefuse): %d %s, want 201", a.status, a.body)
	}
	if k := calls["flaky"]; len(k) != 2 || k[0] != k[1] {
		t.Fatalf("the flaky step ran with keys %v, want twice with the same derived key", k)
	}
}

var errProvider503 = errors.New("provider: 503")

// StepFinalOf wraps an error in more context around StepFinal: still final.
func StepFinalOf(err error) error { return fmt.Errorf("charge: %w", idem.StepFinal(err)) }

// The handler's mistakes and the edges of the API: each is an error, and fn
// does not run where it must not.
func TestStepMisuse(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	clk := newClock()
	type result struct {
		name string
		err  error
		ran  int
	}
	var results []result
	record := func(name string, ran int, err error) { results = append(results, result{name, err, ran}) }
	srv := stepServer(t, mem, idem.Config{NowFunc: clk.Now}, func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		ran := 0
		count := func(context.Context, string) (int, error) { ran++; return ran, nil }

		ran = 0
		_, err := idem.Step(ctx, strings.Repeat("n", idem.MaxStepNameLength+1), count)
		record("long name", ran, err)
		ran = 0
		_, err = idem.Step(ctx, "two words", count)
		record("space in name", ran, err)
		ran = 0
		_, err = idem.Step(ctx, "", count)
		record("empty name", ran, err)
		ran = 0
		v, err := idem.Step(ctx, strings.Repeat("n", idem.MaxStepNameLength), count)
		if v != 1 {
			err = fmt.Errorf("longest name: got %d", v)
		}
		record("longest name", ran, err)

		// The same name again, later: the recorded result, not a second run.
		ran = 0
		a, err1 := idem.Step(ctx, "twice", count)
		b, err2 := idem.Step(ctx, "twice", func(context.Context, string) (int, error) { ran += 10; return 99, nil })
		if a != 1 || b != 1 {
			err1 = fmt.Errorf("twice: %d then %d", a, b)
		}
		record("same name twice", ran, errors.Join(err1, err2))

		// The same name at once (reentrant): the inner call is refused.
		ran = 0
		_, err = idem.Step(ctx, "reentrant", func(ctx context.Context, key string) (int, error) {
			ran++
			_, inner := idem.Step(ctx, "reentrant", count)
			return 0, inner
		})
		record("reentrant", ran, err)

		// A result that cannot be encoded at all: refused before the step begins.
		ran = 0
		_, err = idem.Step(ctx, "chan", func(context.Context, string) (chan int, error) { ran++; return nil, nil })
		record("unencodable type", ran, err)

		// A result that encodes and does not decode back: not recorded.
		ran = 0
		_, err = idem.Step(ctx, "oneway", func(context.Context, string) (oneWay, error) { ran++; return oneWay{}, nil })
		record("one-way result", ran, err)

		// A lossy type: the first run returns what a replay will (the
		// unexported field is lost on both).
		ran = 0
		lv, err := idem.Step(ctx, "lossy", func(context.Context, string) (lossy, error) { ran++; return lossy{Shown: "a", hidden: "b"}, nil })
		if lv.hidden != "" || lv.Shown != "a" {
			err = fmt.Errorf("lossy: the first run returned %+v, not the recorded value", lv)
		}
		record("lossy type", ran, err)

		// StepKey knows the derived key of a step this execution ran.
		k, ok := idem.StepKey(ctx, "twice")
		if !ok || !strings.HasPrefix(k, "idem_") {
			err = fmt.Errorf("StepKey = %q, %v", k, ok)
		} else {
			err = nil
		}
		record("StepKey", 0, err)
		if _, ok := idem.StepKey(ctx, "never"); ok {
			record("StepKey of a step never run", 0, errors.New("ok"))
		}
		w.WriteHeader(http.StatusCreated)
	})
	if a := srv.post(t, "misuse"); a.status != http.StatusCreated {
		t.Fatalf("%d %s", a.status, a.body)
	}
	want := map[string]struct {
		ok  bool
		ran int
		in  string
	}{
		"long name":        {false, 0, "invalid step name"},
		"space in name":    {false, 0, "not visible ASCII"},
		"empty name":       {false, 0, "invalid step name"},
		"longest name":     {true, 1, ""},
		"same name twice":  {true, 1, ""},
		"reentrant":        {false, 1, "already running in this execution"},
		"unencodable type": {false, 0, "cannot be encoded"},
		"one-way result":   {false, 1, "does not round-trip"},
		"lossy type":       {true, 1, ""},
		"StepKey":          {true, 0, ""},
	}
	if len(results) != len(want) {
		t.Errorf("%d results, want %d: %v", len(results), len(want), results)
	}
	for _, r := range results {
		w := want[r.name]
		if (r.err == nil) != w.ok || r.ran != w.ran || (w.in != "" && (r.err == nil || !strings.Contains(r.err.Error(), w.in))) {
			t.Errorf("%s: err %v, fn ran %d times; want ok=%v, %d runs, error containing %q", r.name, r.err, r.ran, w.ok, w.ran, w.in)
		}
	}
	steps := stepsOf(t, mem, "misuse", clk.Now())
	if st, ok := steps["oneway"]; !ok || st.State != idem.StepStarted {
		t.Errorf("the step whose result did not round-trip is %+v, want left started", st)
	}
	if _, ok := steps["chan"]; ok {
		t.Errorf("the step of an unencodable type was begun")
	}
	var oneWayErr error
	for _, r := range results {
		if r.name == "one-way result" {
			oneWayErr = r.err
		}
	}
	if !errors.Is(oneWayErr, idem.ErrStepNotRecorded) {
		t.Errorf("one-way result: %v, want ErrStepNotRecorded", oneWayErr)
	}
}

// oneWay encodes to something it does not decode from.
type oneWay struct{}

func (oneWay) MarshalJSON() ([]byte, error) { return []byte(`"x"`), nil }
func (*oneWay) UnmarshalJSON([]byte) error  { return errors.New("never") }

type lossy struct {
	Shown  string
	hidden string
}

// Step outside an operation idem runs, and with a store that keeps no steps.
func TestStepWithoutStepStore(t *testing.T) {
	t.Parallel()
	ran := 0
	fn := func(context.Context, string) (int, error) { ran++; return 1, nil }
	if _, err := idem.Step(context.Background(), "charge", fn); !errors.Is(err, idem.ErrNoStepStore) {
		t.Fatalf("Step with a context not from idem: %v, want ErrNoStepStore", err)
	}
	var got error
	srv := stepServer(t, plainStore{stepMem(t)}, idem.Config{}, func(w http.ResponseWriter, r *http.Request) {
		_, got = idem.Step(r.Context(), "charge", fn)
		// The client's context is not the handler's: also no step store.
		w.WriteHeader(http.StatusCreated)
	})
	srv.post(t, "k")
	if !errors.Is(got, idem.ErrNoStepStore) || !strings.Contains(got.Error(), "plainStore") || ran != 0 {
		t.Fatalf("Step with a store that is no StepStore: %v (ran %d), want ErrNoStepStore naming the store", got, ran)
	}
}

// plainStore hides memstore's step methods.
type plainStore struct{ s *memstore.Store }

func (p plainStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	return p.s.Claim(ctx, req)
}
func (p plainStore) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, exp time.Time) error {
	return p.s.Complete(ctx, scope, key, token, resp, now, exp)
}
func (p plainStore) Release(ctx context.Context, scope, key, token string) error {
	return p.s.Release(ctx, scope, key, token)
}
func (p plainStore) Extend(ctx context.Context, scope, key, token string, now, lease time.Time) error {
	return p.s.Extend(ctx, scope, key, token, now, lease)
}
func (p plainStore) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	return p.s.Get(ctx, scope, key, now)
}
func (p plainStore) DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error) {
	return p.s.DeleteExpired(ctx, now, limit)
}

// A handler whose lease lapsed and was taken over: its Step is refused with
// ErrLockLost and the step does not run; the execution that took over runs it.
func TestStepAfterLeaseLost(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	clk := newClock()
	p := newProvider(false)
	inside, resume := make(chan struct{}), make(chan struct{})
	var first sync.Once
	var lostErr error
	var mu sync.Mutex
	mw, err := idem.New(mem, &idem.Config{NowFunc: clk.Now, Lease: 5 * time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		isFirst := false
		first.Do(func() { isFirst = true })
		if isFirst {
			close(inside)
			<-resume
		}
		_, err := idem.Step(r.Context(), "charge", chargeStep(p))
		if isFirst {
			mu.Lock()
			lostErr = err
			mu.Unlock()
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})))
	done := make(chan answer)
	go func() { done <- postAnswer(t, srv, "order-1") }()
	<-inside
	clk.Add(6 * time.Minute) // the first holder's lease lapses
	if a := postAnswer(t, srv, "order-1"); a.status != http.StatusCreated {
		t.Fatalf("the takeover: %d %s", a.status, a.body)
	}
	close(resume)
	<-done
	mu.Lock()
	defer mu.Unlock()
	if !errors.Is(lostErr, idem.ErrLockLost) {
		t.Fatalf("Step of the holder that was taken over: %v, want ErrLockLost", lostErr)
	}
	if calls, charges := p.total(); calls != 1 || charges != 1 {
		t.Fatalf("provider calls %d, charges %d; want 1 and 1 (the taken-over holder must not charge)", calls, charges)
	}
}

// A key reused after its TTL is a new operation: its step runs again, with a
// new derived key. Steps of different keys, scopes and names have different
// derived keys, none containing the client's key.
func TestStepDerivedKeys(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	clk := newClock()
	p := newProvider(false)
	var mu sync.Mutex
	seen := map[string]string{}
	srv := stepServer(t, mem, idem.Config{NowFunc: clk.Now, TTL: time.Hour, ScopeFunc: func(r *http.Request) string { return r.Header.Get("Tenant") }}, func(w http.ResponseWriter, r *http.Request) {
		for _, name := range []string{"charge", "ship"} {
			_, err := idem.Step(r.Context(), name, func(ctx context.Context, key string) (string, error) {
				mu.Lock()
				defer mu.Unlock()
				seen[fmt.Sprintf("%s/%s/%s/%s", r.Header.Get("Tenant"), r.Header.Get("Idempotency-Key"), name, clk.Now().Format(time.TimeOnly))] = key
				return p.charge(key), nil
			})
			if err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
		}
		w.WriteHeader(http.StatusCreated)
	})
	send := func(tenant, key string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		req.Header.Set("Tenant", tenant)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
	}
	send("a", "secret-key-1")
	send("a", "secret-key-1") // replay: no step runs
	send("a", "secret-key-2")
	send("b", "secret-key-1")
	clk.Add(2 * time.Hour) // past the TTL
	send("a", "secret-key-1")
	mu.Lock()
	defer mu.Unlock()
	if len(seen) != 8 {
		t.Fatalf("%d step runs, want 8 (2 steps × 4 operations): %v", len(seen), seen)
	}
	unique := map[string]bool{}
	for what, k := range seen {
		if len(k) != len("idem_")+32 || !strings.HasPrefix(k, "idem_") || strings.Contains(k, "secret") {
			t.Errorf("%s: derived key %q, want idem_ and 32 characters, nothing of the client's key", what, k)
		}
		unique[k] = true
	}
	if len(unique) != len(seen) {
		t.Fatalf("derived keys repeat across scopes, keys, names or TTLs: %v", seen)
	}
}

// ErrStepNotRecorded: the step ran and its outcome could not be recorded; the
// step stays begun, and the retry runs it again with the same derived key.
func TestStepNotRecorded(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	store := &failingFinish{Store: mem}
	store.fail.Store(true)
	clk := newClock()
	var keys []string
	var got error
	srv := stepServer(t, store, idem.Config{NowFunc: clk.Now, KeepFunc: func(s int) bool { return s < 500 }}, func(w http.ResponseWriter, r *http.Request) {
		v, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (int, error) {
			keys = append(keys, key)
			return 7, nil
		})
		if err != nil {
			got = err
			if v != 0 {
				got = fmt.Errorf("a result %d came with the error", v)
			}
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	if a := srv.post(t, "k"); a.status != http.StatusServiceUnavailable {
		t.Fatalf("%d %s", a.status, a.body)
	}
	if !errors.Is(got, idem.ErrStepNotRecorded) || !strings.Contains(got.Error(), "disk full") {
		t.Fatalf("Step with a failing FinishStep: %v, want ErrStepNotRecorded with the cause", got)
	}
	store.fail.Store(false)
	if a := srv.post(t, "k"); a.status != http.StatusCreated {
		t.Fatalf("%d %s", a.status, a.body)
	}
	if len(keys) != 2 || keys[0] != keys[1] {
		t.Fatalf("keys %v, want the step run twice with one derived key", keys)
	}
}

type failingFinish struct {
	*memstore.Store
	fail atomic.Bool
}

func (s *failingFinish) FinishStep(ctx context.Context, scope, key, name, owner string, st idem.StepState, result []byte, now time.Time) error {
	if s.fail.Load() {
		return errors.New("disk full")
	}
	return s.Store.FinishStep(ctx, scope, key, name, owner, st, result, now)
}

// Concurrent Step calls of different names in one handler all run, once each.
func TestStepConcurrentNamesInOneHandler(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	clk := newClock()
	const n = 8
	var mu sync.Mutex
	ran := map[string]int{}
	srv := stepServer(t, mem, idem.Config{NowFunc: clk.Now}, func(w http.ResponseWriter, r *http.Request) {
		var wg sync.WaitGroup
		errs := make([]error, 2*n)
		for i := range 2 * n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				name := fmt.Sprintf("s%d", i%n) // each name twice, at once
				_, errs[i] = idem.Step(r.Context(), name, func(ctx context.Context, key string) (string, error) {
					mu.Lock()
					ran[name]++
					mu.Unlock()
					time.Sleep(5 * time.Millisecond)
					return key, nil
				})
			}()
		}
		wg.Wait()
		running := 0
		for _, err := range errs {
			if err != nil {
				if !strings.Contains(err.Error(), "already running") {
					http.Error(w, err.Error(), 500)
					return
				}
				running++
			}
		}
		w.Header().Set("X-Running", fmt.Sprint(running))
		w.WriteHeader(http.StatusCreated)
	})
	a := srv.post(t, "k")
	if a.status != http.StatusCreated {
		t.Fatalf("%d %s", a.status, a.body)
	}
	for i := range n {
		if c := ran[fmt.Sprintf("s%d", i)]; c != 1 {
			t.Errorf("step s%d ran %d times, want 1", i, c)
		}
	}
	steps := stepsOf(t, mem, "k", clk.Now())
	if len(steps) != n {
		t.Fatalf("%d steps recorded, want %d", len(steps), n)
	}
	for name, st := range steps {
		var k string
		if st.State != idem.StepDone || json.Unmarshal(st.Result, &k) != nil || k != st.DerivedKey {
			t.Errorf("step %s: %+v", name, st)
		}
	}
}

// fakeSingleTx is memstore as an idem.SingleTxStore: BeginLocked takes a
// per-key lock, Insert writes the record at Commit (claim and complete), and
// failCommit makes the commit fail, writing nothing — a business transaction
// that rolls back after the step was recorded.
type fakeSingleTx struct {
	*memstore.Store
	mu     sync.Mutex
	locked map[string]bool
}

func newFakeSingleTx(s *memstore.Store) *fakeSingleTx {
	return &fakeSingleTx{Store: s, locked: map[string]bool{}}
}

type fakeLockedTx struct {
	s    *fakeSingleTx
	id   string
	rec  *idem.Record
	done bool
}

func (s *fakeSingleTx) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	id := scope + "\x00" + key
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.locked[id] {
		return nil, nil, nil, idem.ErrInFlight
	}
	s.locked[id] = true
	rec, err := s.Get(ctx, scope, key, now)
	if errors.Is(err, idem.ErrNotFound) {
		rec, err = nil, nil
	}
	if err != nil {
		delete(s.locked, id)
		return nil, nil, nil, err
	}
	return ctx, &fakeLockedTx{s: s, id: id}, rec, nil
}

func (tx *fakeLockedTx) Insert(_ context.Context, rec *idem.Record) error {
	c := *rec
	resp := *rec.Response
	resp.Body = append([]byte(nil), resp.Body...)
	c.Response = &resp
	tx.rec = &c
	return nil
}

func (tx *fakeLockedTx) Commit(ctx context.Context) error {
	if tx.done {
		return nil
	}
	defer tx.unlock()
	if r := tx.rec; r != nil {
		if _, ok, err := tx.s.Claim(ctx, idem.ClaimRequest{Scope: r.Scope, Key: r.Key, Fingerprint: r.Fingerprint, Token: r.Token, Now: r.CreatedAt, LeaseUntil: r.LeaseUntil, ExpiresAt: r.ExpiresAt}); err != nil || !ok {
			return errors.Join(idem.ErrInFlight, err)
		}
		return tx.s.Complete(ctx, r.Scope, r.Key, r.Token, r.Response, r.LeaseUntil, r.ExpiresAt)
	}
	return nil
}

func (tx *fakeLockedTx) Rollback(context.Context) error {
	if !tx.done {
		tx.unlock()
	}
	return nil
}

func (tx *fakeLockedTx) unlock() {
	tx.done = true
	tx.s.mu.Lock()
	delete(tx.s.locked, tx.id)
	tx.s.mu.Unlock()
}

// In the single-transaction flow a step's record is committed on its own: the
// handler's transaction rolling back (an error answer not kept) leaves it, and
// the retry's Step returns it without running the step.
func TestStepSurvivesSingleTxRollback(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	clk := newClock()
	p := newProvider(false)
	runs := 0
	srv := stepServer(t, newFakeSingleTx(mem), idem.Config{NowFunc: clk.Now, Flow: idem.FlowSingleTx, KeepFunc: func(s int) bool { return s < 500 }}, func(w http.ResponseWriter, r *http.Request) {
		runs++
		ch, err := idem.Step(r.Context(), "charge", chargeStep(p))
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		if runs == 1 {
			http.Error(w, "the order insert failed", http.StatusInternalServerError) // rolled back, not kept
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(ch.ID))
	})
	if a := srv.post(t, "order-1"); a.status != http.StatusInternalServerError {
		t.Fatalf("%d %s", a.status, a.body)
	}
	if st := stepsOf(t, mem, "order-1", clk.Now())["charge"]; st.State != idem.StepDone {
		t.Fatalf("after the rollback the step is %+v, want done", st)
	}
	if _, err := mem.Get(context.Background(), idem.StoredScope(""), "order-1", clk.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("the rolled-back request left a record: %v", err)
	}
	a := srv.post(t, "order-1")
	calls, _ := p.total()
	if a.status != http.StatusCreated || calls != 1 || runs != 2 {
		t.Fatalf("retry: %d %s, provider calls %d, runs %d; want 201, 1 call, 2 runs", a.status, a.body, calls, runs)
	}
}

// StepAmbiguous: a failure after which the service may have acted leaves the
// step begun, so that StepRefuse refuses it on the retry (a plain transient
// error would let it run again).
func TestStepAmbiguousFailure(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	clk := newClock()
	calls := 0
	errTimeout := errors.New("provider: timeout after the request was sent")
	var got []error
	srv := stepServer(t, mem, idem.Config{NowFunc: clk.Now, KeepFunc: func(s int) bool { return s < 500 }}, func(w http.ResponseWriter, r *http.Request) {
		_, err := idem.Step(r.Context(), "send", func(ctx context.Context, key string) (int, error) {
			calls++
			return 0, idem.StepAmbiguous(errTimeout)
		}, idem.OnUnknown(idem.StepRefuse))
		got = append(got, err)
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
	})
	srv.post(t, "k")
	if st := stepsOf(t, mem, "k", clk.Now())["send"]; st.State != idem.StepStarted || st.Owner == "" {
		t.Fatalf("after an ambiguous failure the step is %+v, want left begun under its owner", st)
	}
	srv.post(t, "k")
	if calls != 1 || len(got) != 2 || !errors.Is(got[0], errTimeout) || !errors.Is(got[1], idem.ErrStepUnknown) {
		t.Fatalf("calls %d, errors %v; want one call, then ErrStepUnknown", calls, got)
	}
}

// A result type whose MarshalJSON refuses its zero value is not refused
// before the step runs (only types encoding/json cannot encode at all are).
func TestStepTypeRefusingZero(t *testing.T) {
	t.Parallel()
	mem := stepMem(t)
	var got money
	var gotErr error
	srv := stepServer(t, mem, idem.Config{}, func(w http.ResponseWriter, r *http.Request) {
		got, gotErr = idem.Step(r.Context(), "price", func(context.Context, string) (money, error) { return money{Cents: 5, Currency: "EUR"}, nil })
		w.WriteHeader(http.StatusCreated)
	})
	srv.post(t, "k")
	if gotErr != nil || got != (money{Cents: 5, Currency: "EUR"}) {
		t.Fatalf("Step = %+v, %v", got, gotErr)
	}
}

type money struct {
	Cents    int
	Currency string
}

func (m money) MarshalJSON() ([]byte, error) {
	if m.Currency == "" {
		return nil, errors.New("money without a currency")
	}
	type plain money
	return json.Marshal(plain(m))
}

// A goroutine of the handler that calls Step after the request finished (its
// outcome stored) is refused, and its step does not run, in both flows.
func TestStepAfterTheRequestFinished(t *testing.T) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			mem := stepMem(t)
			var store idem.Store = mem
			if flow == idem.FlowSingleTx {
				store = newFakeSingleTx(mem)
			}
			later := make(chan struct{})
			done := make(chan error, 1)
			ran := false
			srv := stepServer(t, store, idem.Config{Flow: flow}, func(w http.ResponseWriter, r *http.Request) {
				ctx := r.Context()
				go func() {
					<-later
					_, err := idem.Step(ctx, "late", func(context.Context, string) (int, error) { ran = true; return 1, nil })
					done <- err
				}()
				w.WriteHeader(http.StatusCreated)
			})
			if a := srv.post(t, "k"); a.status != http.StatusCreated {
				t.Fatalf("%d %s", a.status, a.body)
			}
			close(later)
			if err := <-done; err == nil || ran {
				t.Fatalf("Step after the request finished: %v (ran %v), want refused", err, ran)
			}
			if steps := stepsOf(t, mem, "k", time.Now()); len(steps) != 0 {
				t.Fatalf("a step was recorded after the request finished: %v", steps)
			}
		})
	}
}
