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
)

// gatedStore is a store (as plain idem.Store and idem.StepStore: the
// middleware completes through Complete) whose first BeginStep, once
// entered, waits for the request's Complete to begin (the handler has
// returned by then), and whose Complete waits for that Step to return.
type gatedStore struct {
	idem.Store
	idem.StepStore
	entered, completing, stepDone chan struct{}
	beginOnce, completeOnce       sync.Once
}

func (g *gatedStore) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	g.beginOnce.Do(func() {
		close(g.entered)
		<-g.completing
	})
	return g.StepStore.BeginStep(ctx, req)
}

func (g *gatedStore) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, exp time.Time) error {
	g.completeOnce.Do(func() {
		close(g.completing)
		<-g.stepDone
	})
	return g.Store.Complete(ctx, scope, key, token, resp, now, exp)
}

// TestStepAfterHandlerReturned (SQLite, claim-then-complete, loopback HTTP):
// a goroutine the handler started calls Step, whose BeginStep is still under
// way when the handler has returned and the middleware stores its outcome;
// and another calls Step once the handler has returned. Neither step runs:
// both get ErrStepAfterHandler, and no outcome is recorded (a record begun
// is left abandoned, without owner). The stored answer is the handler's.
// The first failed before: the step began and ran for an answer stored
// without it.
func TestStepAfterHandlerReturned(t *testing.T) {
	t.Parallel()
	s := newSQLiteStore(t)
	g := &gatedStore{Store: s, StepStore: s, entered: make(chan struct{}), completing: make(chan struct{}), stepDone: make(chan struct{})}
	mw, err := idem.New(g, &idem.Config{Flow: idem.FlowClaimComplete})
	if err != nil {
		t.Fatal(err)
	}
	var ran atomic.Int32
	errs := make(chan error, 2)
	srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		step := func(name string) error {
			_, err := idem.Step(ctx, name, func(context.Context, string) (int, error) { ran.Add(1); return 1, nil })
			return err
		}
		go func() {
			errs <- step("begun-as-it-returns")
			<-g.completing // the handler has returned: the middleware completes
			errs <- step("after")
			close(g.stepDone)
		}()
		<-g.entered // the first Step is in BeginStep
		w.WriteHeader(http.StatusCreated)
	})))
	if a := postAnswer(t, srv, "late"); a.status != http.StatusCreated {
		t.Fatalf("%d %s", a.status, a.body)
	}
	for range 2 {
		if err := <-errs; !errors.Is(err, idem.ErrStepAfterHandler) {
			t.Errorf("a Step after the handler returned: %v, want ErrStepAfterHandler", err)
		}
	}
	if n := ran.Load(); n != 0 {
		t.Errorf("%d steps ran after the handler returned, want none", n)
	}
	recs, err := s.GetSteps(context.Background(), idem.StoredScope(""), "late", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	for _, rec := range recs {
		if rec.State != idem.StepStarted || rec.Owner != "" {
			t.Errorf("step %s after the handler returned: %v under %q, want none or abandoned", rec.Name, rec.State, rec.Owner)
		}
	}
	if a := postAnswer(t, srv, "late"); a.status != http.StatusCreated {
		t.Errorf("the retry: %d %s, want the stored 201", a.status, a.body)
	}
}
