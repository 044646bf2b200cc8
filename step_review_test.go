package idem_test

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// TestStepRecordsOutliveTakeovers: an operation whose record stays in flight
// across takeovers keeps every step it recorded, even one the takeover did
// not reach. A records "charge" and "ship" and dies (the record stays in
// flight); B takes the lapsed lease over 50 minutes later (its claim moves the
// record's expiry to B + TTL), replays "charge" and dies before "ship"; C
// takes over 20 minutes after that, past A's start + TTL but well within the
// record's life: "ship" must be replayed, not run again with a new derived
// key (a second shipment at a carrier that honours keys). Failed before the
// fix: the ship step ran twice, with two derived keys.
func TestStepRecordsOutliveTakeovers(t *testing.T) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			mem := stepMem(t)
			var store idem.Store = mem
			if flow == idem.FlowSingleTx {
				store = newFakeSingleTx(mem)
			}
			clk := newClock()
			var mu sync.Mutex
			runs := map[string][]string{} // step name → derived keys it ran with
			run := 0
			srv := stepServer(t, store, idem.Config{NowFunc: clk.Now, Flow: flow, TTL: time.Hour, Lease: time.Minute}, func(w http.ResponseWriter, r *http.Request) {
				run++
				step := func(name string) error {
					_, err := idem.Step(r.Context(), name, func(ctx context.Context, key string) (string, error) {
						mu.Lock()
						runs[name] = append(runs[name], key)
						mu.Unlock()
						return name + "-" + key[5:13], nil
					})
					return err
				}
				if err := step("charge"); err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				if run == 2 { // B dies between the steps
					idem.MarkOutcomeUnknown(r.Context())
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				if err := step("ship"); err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				if run == 1 { // A dies after both steps
					idem.MarkOutcomeUnknown(r.Context())
					w.WriteHeader(http.StatusServiceUnavailable)
					return
				}
				w.WriteHeader(http.StatusCreated)
			})
			if a := srv.post(t, "order-1"); a.status != http.StatusServiceUnavailable {
				t.Fatalf("A: %d %s", a.status, a.body)
			}
			clk.Add(50 * time.Minute)
			if a := srv.post(t, "order-1"); a.status != http.StatusServiceUnavailable {
				t.Fatalf("B (a takeover): %d %s", a.status, a.body)
			}
			clk.Add(20 * time.Minute)
			if a := srv.post(t, "order-1"); a.status != http.StatusCreated {
				t.Fatalf("C (a takeover): %d %s", a.status, a.body)
			}
			mu.Lock()
			defer mu.Unlock()
			if run != 3 || len(runs["charge"]) != 1 || len(runs["ship"]) != 1 {
				t.Fatalf("handler runs %d; the steps ran with derived keys %v; want 3 runs and each step run once", run, runs)
			}
		})
	}
}

// completeGate is memstore whose Complete waits, once, for proceed after
// telling completing: the moment after the handler returned and before its
// outcome is stored.
type completeGate struct {
	*memstore.Store
	completing chan struct{}
	proceed    chan struct{}
	once       sync.Once
}

func (g *completeGate) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, exp time.Time) error {
	g.once.Do(func() {
		close(g.completing)
		<-g.proceed
	})
	return g.Store.Complete(ctx, scope, key, token, resp, now, exp)
}

// TestStepFromGoroutineWhileCompleting: a goroutine the handler started calls
// Step after the handler returned, while the middleware stores the outcome.
// The step must be refused (fn not run): its effect would belong to no
// answer — the stored answer was written without it, and a retry replays
// that answer and never runs the step. Failed before the fix: the step began
// and its function ran (the claim was still held until Complete).
func TestStepFromGoroutineWhileCompleting(t *testing.T) {
	g := &completeGate{Store: stepMem(t), completing: make(chan struct{}), proceed: make(chan struct{})}
	ran := false
	done := make(chan error, 1)
	srv := stepServer(t, g, idem.Config{}, func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		go func() {
			<-g.completing
			_, err := idem.Step(ctx, "late", func(context.Context, string) (int, error) { ran = true; return 1, nil })
			done <- err
			close(g.proceed)
		}()
		w.WriteHeader(http.StatusCreated)
	})
	if a := srv.post(t, "k"); a.status != http.StatusCreated {
		t.Fatalf("%d %s", a.status, a.body)
	}
	if err := <-done; !errors.Is(err, idem.ErrStepAfterHandler) || ran {
		t.Fatalf("Step after the handler returned, while its outcome was stored: %v (ran %v), want ErrStepAfterHandler", err, ran)
	}
	if steps := stepsOf(t, g.Store, "k", time.Now()); len(steps) != 0 {
		t.Fatalf("a step was recorded after the handler returned: %v", steps)
	}
}

// beginGate is memstore whose first BeginStep, once entered, waits for the
// request's Complete to begin (the handler has returned by then), and whose
// Complete waits for that BeginStep's Step to return.
type beginGate struct {
	*memstore.Store
	entered, completing, stepDone chan struct{}
	beginOnce, completeOnce       sync.Once
}

func (g *beginGate) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	g.beginOnce.Do(func() {
		close(g.entered)
		<-g.completing
	})
	return g.Store.BeginStep(ctx, req)
}

func (g *beginGate) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, exp time.Time) error {
	g.completeOnce.Do(func() {
		close(g.completing)
		<-g.stepDone
	})
	return g.Store.Complete(ctx, scope, key, token, resp, now, exp)
}

// TestStepBegunAsHandlerReturns: a goroutine the handler started calls Step
// just before the handler returns; the step's BeginStep is still under way
// when the handler has returned and the middleware stores its outcome. The
// step must not run: Step returns ErrStepAfterHandler, its function is not
// called, and no outcome is recorded (the record begun is abandoned, with no
// owner). Failed before: the step began and its function ran, for an answer
// stored without it.
func TestStepBegunAsHandlerReturns(t *testing.T) {
	g := &beginGate{Store: stepMem(t), entered: make(chan struct{}), completing: make(chan struct{}), stepDone: make(chan struct{})}
	var ran atomic.Bool
	done := make(chan error, 1)
	srv := stepServer(t, g, idem.Config{}, func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		go func() {
			_, err := idem.Step(ctx, "late", func(context.Context, string) (int, error) { ran.Store(true); return 1, nil })
			done <- err
			close(g.stepDone)
		}()
		<-g.entered // the goroutine's Step is in BeginStep
		w.WriteHeader(http.StatusCreated)
	})
	if a := srv.post(t, "k"); a.status != http.StatusCreated {
		t.Fatalf("%d %s", a.status, a.body)
	}
	if err := <-done; !errors.Is(err, idem.ErrStepAfterHandler) || ran.Load() {
		t.Fatalf("Step begun as the handler returned: %v (ran %v), want ErrStepAfterHandler and not run", err, ran.Load())
	}
	for name, rec := range stepsOf(t, g.Store, "k", time.Now()) {
		if rec.State != idem.StepStarted || rec.Owner != "" {
			t.Errorf("step %s after the handler returned: %v under %q, want none or abandoned", name, rec.State, rec.Owner)
		}
	}
}
