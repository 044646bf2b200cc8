package idemobs_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/memstore"
)

// nopObserver observes nothing.
type nopObserver struct{}

func (nopObserver) StoreStart(ctx context.Context, _ idemobs.Op) context.Context { return ctx }
func (nopObserver) StoreDone(context.Context, idemobs.Op, time.Duration, error)  {}

// plainStore is a Store that keeps no step records.
type plainStore struct{ idem.Store }

// TestStoreForwardsSteps: a decorated StepStore is a StepStore whose step
// operations reach the decorated store (idem.Step found no StepStore behind
// the demo's metrics decorator); a decorated store without steps is none.
func TestStoreForwardsSteps(t *testing.T) {
	mem := memstore.New(nil)
	ss, ok := idemobs.Store(mem, nopObserver{}).(idem.StepStore)
	if !ok {
		t.Fatal("idemobs.Store(memstore) is no idem.StepStore")
	}
	ctx, now := context.Background(), time.Now()
	_, began, err := ss.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: "k", Name: "charge", Owner: "o1", DerivedKey: "idem_x", Now: now, ExpiresAt: now.Add(time.Hour)})
	if err != nil || !began {
		t.Fatalf("BeginStep through the decorator: began=%v %v", began, err)
	}
	if err := ss.FinishStep(ctx, "s", "k", "charge", "o1", idem.StepDone, []byte(`{"id":"ch_1"}`), now); err != nil {
		t.Fatal(err)
	}
	recs, err := mem.GetSteps(ctx, "s", "k", now)
	if err != nil || len(recs) != 1 || recs[0].State != idem.StepDone || string(recs[0].Result) != `{"id":"ch_1"}` {
		t.Fatalf("the decorated store holds %+v (%v), want the done step", recs, err)
	}
	// Only a StepStore decorates as one.
	if _, ok := idemobs.Store(plainStore{mem}, nopObserver{}).(idem.StepStore); ok {
		t.Fatal("a store without steps became a StepStore")
	}
	if _, ok := idemobs.Store(idemobs.Store(mem, nopObserver{}), nopObserver{}).(idem.TxStore); ok {
		t.Fatal("memstore is no TxStore, its decorator must not be one")
	}
}
