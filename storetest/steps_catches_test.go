package storetest_test

import (
	"context"
	"os"
	"os/exec"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/storetest"
)

// The step cases catch planted bugs: each bug below is planted in memstore's
// step records (stepBugStore), and RunSteps must fail on it in the subtest
// that names the broken guarantee.

type stepBug string

const (
	holderIgnored     stepBug = "holder-ignored"       // BeginStep ignores Holder
	checkThenBegin    stepBug = "check-then-begin"     // reads, waits, then writes: two owners begin
	rerunIgnored      stepBug = "rerun-ignored"        // BeginStep never takes a started step over
	unfencedFinish    stepBug = "unfenced-finish"      // FinishStep finishes whoever's step it is
	getExpiredSteps   stepBug = "get-expired-steps"    // GetSteps returns expired steps
	expiryNeverMoves  stepBug = "expiry-never-moves"   // BeginStep keeps a live record's expiry
	truncatedNames    stepBug = "truncated-names"      // names cut to 50 bytes
	stepsByName       stepBug = "steps-by-name"        // GetSteps ordered by name
	sweepDeletesLive  stepBug = "sweep-deletes-live"   // DeleteExpiredSteps deletes live steps
	abandonForgetsKey stepBug = "abandon-forgets-key"  // AbandonStep deletes the record: a new derived key
	settleAnyState    stepBug = "settle-absent-writes" // SettleStep of an absent step is not ErrNotFound
	firstIgnored      stepBug = "first-ignored"        // BeginStep ignores First: only the step's own record is compared
)

// stepBugStore is memstore with one planted step bug.
type stepBugStore struct {
	*memstore.Store
	bug stepBug
}

func (s stepBugStore) name(n string) string {
	if s.bug == truncatedNames && len(n) > 50 {
		return n[:50]
	}
	return n
}

func (s stepBugStore) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	req.Name = s.name(req.Name)
	switch s.bug {
	case holderIgnored:
		req.Holder = false
	case rerunIgnored:
		req.Rerun = false
	case firstIgnored:
		req.First = false
	case checkThenBegin:
		recs, err := s.Store.GetSteps(ctx, req.Scope, req.Key, req.Now)
		if err != nil {
			return nil, false, err
		}
		for _, r := range recs {
			if r.Name == req.Name {
				return s.Store.BeginStep(ctx, req)
			}
		}
		time.Sleep(200 * time.Microsecond)
		_ = s.Store.SettleStep(ctx, req.Scope, req.Key, req.Name, 0, nil, req.Now) // the unconditional write
		return s.Store.BeginStep(ctx, req)
	case expiryNeverMoves:
		recs, err := s.Store.GetSteps(ctx, req.Scope, req.Key, req.Now)
		if err != nil {
			return nil, false, err
		}
		for _, r := range recs {
			if r.Name == req.Name {
				req.ExpiresAt = r.ExpiresAt
			}
		}
	}
	return s.Store.BeginStep(ctx, req)
}

func (s stepBugStore) FinishStep(ctx context.Context, scope, key, name, owner string, st idem.StepState, result []byte, now time.Time) error {
	name = s.name(name)
	if s.bug == unfencedFinish {
		recs, _ := s.Store.GetSteps(ctx, scope, key, now)
		for _, r := range recs {
			if r.Name == name && r.Owner != "" {
				owner = r.Owner
			}
		}
	}
	return s.Store.FinishStep(ctx, scope, key, name, owner, st, result, now)
}

func (s stepBugStore) AbandonStep(ctx context.Context, scope, key, name, owner string, now time.Time) error {
	name = s.name(name)
	if err := s.Store.AbandonStep(ctx, scope, key, name, owner, now); err != nil || s.bug != abandonForgetsKey {
		return err
	}
	return s.Store.SettleStep(ctx, scope, key, name, 0, nil, now)
}

func (s stepBugStore) GetSteps(ctx context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	at := now
	if s.bug == getExpiredSteps {
		at = time.Time{}
	}
	recs, err := s.Store.GetSteps(ctx, scope, key, at)
	if s.bug == stepsByName {
		sort.Slice(recs, func(i, j int) bool { return recs[i].Name < recs[j].Name })
	}
	return recs, err
}

func (s stepBugStore) SettleStep(ctx context.Context, scope, key, name string, st idem.StepState, result []byte, now time.Time) error {
	name = s.name(name)
	err := s.Store.SettleStep(ctx, scope, key, name, st, result, now)
	if s.bug == settleAnyState {
		return nil
	}
	return err
}

func (s stepBugStore) DeleteExpiredSteps(ctx context.Context, now time.Time, limit int) (int, error) {
	if s.bug == sweepDeletesLive {
		now = now.Add(24 * time.Hour)
	}
	return s.Store.DeleteExpiredSteps(ctx, now, limit)
}

func newStepBugStore(t *testing.T, b stepBug) idem.Store {
	s := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = s.Close() })
	return stepBugStore{s, b}
}

const brokenStepEnv = "IDEM_STORETEST_PLANTED_STEP_BUG"

// TestRunStepsOnPlantedBug is the child of TestRunStepsCatchesPlantedBugs.
func TestRunStepsOnPlantedBug(t *testing.T) {
	b, ok := os.LookupEnv(brokenStepEnv)
	if !ok {
		t.Skip("run by TestRunStepsCatchesPlantedBugs")
	}
	storetest.RunSteps(t, func(t *testing.T) idem.Store { return newStepBugStore(t, stepBug(b)) })
}

// TestRunStepsPassesMemstore: without a bug the wrapper is memstore, which
// passes, so the failures below are the bugs'.
func TestRunStepsPassesMemstore(t *testing.T) {
	t.Parallel()
	storetest.RunSteps(t, func(t *testing.T) idem.Store { return newStepBugStore(t, "") })
}

func TestRunStepsCatchesPlantedBugs(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("runs the step cases once per planted bug")
	}
	cases := map[stepBug][]string{
		holderIgnored:     {"HolderFence"},
		checkThenBegin:    {"BeginRace"},
		rerunIgnored:      {"Rerun"},
		unfencedFinish:    {"Finish", "Rerun"},
		getExpiredSteps:   {"Expiry"},
		expiryNeverMoves:  {"ExpiryMovedLater"},
		truncatedNames:    {"HostileNames"},
		stepsByName:       {"GetStepsOrder"},
		sweepDeletesLive:  {"DeleteExpiredSteps"},
		abandonForgetsKey: {"Abandon"},
		settleAnyState:    {"Settle"},
		firstIgnored:      {"OtherRequestFirst"},
	}
	for b, want := range cases {
		t.Run(string(b), func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestRunStepsOnPlantedBug$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), brokenStepEnv+"="+string(b))
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("storetest.RunSteps passed a store whose %s:\n%s", b, tail(out))
			}
			for _, name := range want {
				if strings.Contains(string(out), "--- FAIL: TestRunStepsOnPlantedBug/"+name+" ") || strings.Contains(string(out), "--- FAIL: TestRunStepsOnPlantedBug/"+name+"/") {
					return
				}
			}
			t.Errorf("storetest.RunSteps failed, but not in %v:\n%s", want, tail(out))
		})
	}
}

// The step linearizability check passes memstore and finds planted bugs
// with a counterexample.
func TestStepLinearizability(t *testing.T) {
	t.Parallel()
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		storetest.RunStepLinearizability(t, newStepBugStore(t, ""), &storetest.LinearizabilityOptions{Ops: 4000})
	})
	for _, b := range []stepBug{holderIgnored, rerunIgnored, unfencedFinish, expiryNeverMoves, abandonForgetsKey} {
		t.Run(string(b), func(t *testing.T) {
			t.Parallel()
			res, err := storetest.CheckStepLinearizability(context.Background(), newStepBugStore(t, b), storetest.LinearizabilityOptions{Ops: 20000})
			if err != nil {
				t.Fatal(err)
			}
			if res.Linearizable {
				t.Fatalf("the planted bug was not found in %d operations (%v)", res.Ops, res.Counts)
			}
			if !strings.Contains(res.Problem, "NOT linearizable") || !strings.Contains(res.Problem, "can come next") {
				t.Errorf("the problem does not read as a counterexample: %s", res.Problem)
			}
			t.Logf("found after %v:\n%s", res.Duration, res.Problem)
			_ = os.RemoveAll(strings.TrimSuffix(res.Visualization, "/history.html"))
		})
	}
}
