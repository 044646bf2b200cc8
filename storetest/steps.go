package storetest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// The step cases: the contract of idem.StepStore (recorded steps, issue 27).
// Run runs them, as "Steps/…" subtests, against every store that implements
// idem.StepStore, and skips them for one that does not; RunSteps runs only
// them and fails for a store that is not a StepStore.

// runStepsIn is Run's "Steps" group: the step cases when newStore's stores
// are idem.StepStores, skipped otherwise.
func runStepsIn(t *testing.T, newStore func(t *testing.T) idem.Store) {
	t.Run("Steps", func(t *testing.T) {
		t.Parallel()
		s := newStore(t)
		if _, ok := s.(idem.StepStore); !ok {
			t.Skipf("%T is not an idem.StepStore", s)
		}
		RunSteps(t, newStore)
	})
}

// RunSteps runs the idem.StepStore cases against stores made by newStore (as
// Run does, one store per subtest); it fails the test when a store is not an
// idem.StepStore. Run includes the same cases.
func RunSteps(t *testing.T, newStore func(t *testing.T) idem.Store) {
	t.Helper()
	for _, tc := range stepCases() {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newStore(t)
			if s == nil {
				t.Fatal("newStore returned nil")
			}
			ss, ok := s.(idem.StepStore)
			if !ok {
				t.Fatalf("%T is not an idem.StepStore", s)
			}
			tc.fn(t, s, ss)
		})
	}
}

type stepCase struct {
	name string
	fn   func(t *testing.T, s idem.Store, ss idem.StepStore)
}

func stepCases() []stepCase {
	return []stepCase{
		{"Begin", testStepBegin},
		{"Finish", testStepFinish},
		{"Abandon", testStepAbandon},
		{"Rerun", testStepRerun},
		{"Refuse", testStepRefuse},
		{"OtherRequest", testStepOtherRequest},
		{"OtherRequestFirst", testStepOtherRequestFirst},
		{"HolderFence", testStepHolderFence},
		{"HolderPastTTL", testStepHolderPastTTL},
		{"Expiry", testStepExpiry},
		{"ExpiryMovedLater", testStepExpiryMovedLater},
		{"BeginRace", testStepBeginRace},
		{"Settle", testStepSettle},
		{"GetStepsOrder", testGetStepsOrder},
		{"DeleteExpiredSteps", testDeleteExpiredSteps},
		{"HostileNames", testStepHostileNames},
		{"LargeResult", testStepLargeResult},
		{"HugeResult", testStepHugeResult},
		{"DuringTx", testStepDuringTx},
		{"DuringSingleTx", testStepDuringSingleTx},
		{"Linearizable", testStepsLinearizable},
	}
}

// stepOf names one step of a fixture's operation.
type stepOf struct {
	fixture
	name string
}

func newStep(t *testing.T, name string) stepOf { return stepOf{newFixture(t), name} }

func (st stepOf) begin(owner string, now time.Time, ttl time.Duration) idem.BeginStepRequest {
	return idem.BeginStepRequest{
		Scope: st.scope, Key: st.key, Name: st.name, Owner: owner,
		DerivedKey: "idem_" + randToken(), Now: now, ExpiresAt: now.Add(ttl),
	}
}

func beginStep(t *testing.T, ss idem.StepStore, req idem.BeginStepRequest) (*idem.StepRecord, bool) {
	t.Helper()
	rec, began, err := ss.BeginStep(ctxFor(t), req)
	if err != nil {
		t.Fatalf("BeginStep(%q, %q, %q, owner %q, rerun %v, holder %v): %v", req.Scope, req.Key, req.Name, req.Owner, req.Rerun, req.Holder, err)
	}
	if rec == nil {
		t.Fatalf("BeginStep(%q) returned a nil record and no error", req.Name)
	}
	if rec.Scope != req.Scope || rec.Key != req.Key || rec.Name != req.Name {
		t.Fatalf("BeginStep returned the record of (%q, %q, %q), want (%q, %q, %q)", rec.Scope, rec.Key, rec.Name, req.Scope, req.Key, req.Name)
	}
	return rec, began
}

func mustBegin(t *testing.T, ss idem.StepStore, req idem.BeginStepRequest) *idem.StepRecord {
	t.Helper()
	rec, began := beginStep(t, ss, req)
	if !began {
		t.Fatalf("BeginStep(%q, owner %q) did not begin (record %+v), want began", req.Name, req.Owner, rec)
	}
	if rec.State != idem.StepStarted || rec.Owner != req.Owner {
		t.Fatalf("BeginStep(%q) began, and the record is %v under %q; want started under %q", req.Name, rec.State, rec.Owner, req.Owner)
	}
	return rec
}

func mustNotBegin(t *testing.T, ss idem.StepStore, req idem.BeginStepRequest) *idem.StepRecord {
	t.Helper()
	rec, began := beginStep(t, ss, req)
	if began {
		t.Fatalf("BeginStep(%q, owner %q, rerun %v) began (record %+v), want the existing record", req.Name, req.Owner, req.Rerun, rec)
	}
	return rec
}

// getSteps returns the live steps of st's operation by name.
func getSteps(t *testing.T, ss idem.StepStore, f fixture, now time.Time) map[string]idem.StepRecord {
	t.Helper()
	recs, err := ss.GetSteps(ctxFor(t), f.scope, f.key, now)
	if err != nil {
		t.Fatalf("GetSteps(%q, %q): %v", f.scope, f.key, err)
	}
	m := map[string]idem.StepRecord{}
	for _, r := range recs {
		if r.Scope != f.scope || r.Key != f.key {
			t.Fatalf("GetSteps(%q, %q) returned a step of (%q, %q)", f.scope, f.key, r.Scope, r.Key)
		}
		if _, dup := m[r.Name]; dup {
			t.Fatalf("GetSteps returned step %q twice", r.Name)
		}
		m[r.Name] = r
	}
	return m
}

func mustStep(t *testing.T, ss idem.StepStore, st stepOf, now time.Time) idem.StepRecord {
	t.Helper()
	r, ok := getSteps(t, ss, st.fixture, now)[st.name]
	if !ok {
		t.Fatalf("GetSteps has no step %q, want it", st.name)
	}
	return r
}

func wantNoStep(t *testing.T, ss idem.StepStore, st stepOf, now time.Time) {
	t.Helper()
	if r, ok := getSteps(t, ss, st.fixture, now)[st.name]; ok {
		t.Fatalf("GetSteps has step %q (%+v), want none", st.name, r)
	}
}

// checkStep compares a step record with what it must be.
func checkStep(t *testing.T, what string, got *idem.StepRecord, state idem.StepState, owner, derived string, result []byte) {
	t.Helper()
	if got.State != state {
		t.Errorf("%s: State = %v, want %v", what, got.State, state)
	}
	if state == idem.StepStarted && got.Owner != owner {
		t.Errorf("%s: Owner = %q, want %q", what, got.Owner, owner)
	}
	if got.DerivedKey != derived {
		t.Errorf("%s: DerivedKey = %q, want %q (it never changes while the record lives)", what, got.DerivedKey, derived)
	}
	if state == idem.StepStarted {
		if len(got.Result) != 0 {
			t.Errorf("%s: Result = %q on a started step, want none", what, got.Result)
		}
	} else if !bytes.Equal(got.Result, result) {
		t.Errorf("%s: Result = %q (%d bytes), want %q (%d bytes), byte for byte", what, clip(got.Result), len(got.Result), clip(result), len(result))
	}
}

func clip(b []byte) []byte {
	if len(b) > 80 {
		return append(append([]byte{}, b[:80]...), "…"...)
	}
	return b
}

// testStepBegin: the first BeginStep writes a started record with the owner,
// the derived key and the times it was given; a second BeginStep by the same
// owner begins nothing and returns that record.
func testStepBegin(t *testing.T, _ idem.Store, ss idem.StepStore) {
	st := newStep(t, "charge")
	now := time.Now()
	req := st.begin("own-"+randToken(), now, longTTL)
	rec := mustBegin(t, ss, req)
	checkStep(t, "the new record", rec, idem.StepStarted, req.Owner, req.DerivedKey, nil)
	if !sameTime(rec.StartedAt, now) || !sameTime(rec.ExpiresAt, req.ExpiresAt) {
		t.Errorf("StartedAt, ExpiresAt = %v, %v; want %v, %v", rec.StartedAt, rec.ExpiresAt, now, req.ExpiresAt)
	}
	again := req
	again.DerivedKey = "idem_other"
	again.Rerun = true
	rec2 := mustNotBegin(t, ss, again)
	checkStep(t, "BeginStep by its own owner again (the same name used twice in one execution)", rec2, idem.StepStarted, req.Owner, req.DerivedKey, nil)
	got := mustStep(t, ss, st, now)
	checkStep(t, "GetSteps", &got, idem.StepStarted, req.Owner, req.DerivedKey, nil)
	if !sameTime(got.StartedAt, now) || !sameTime(got.ExpiresAt, req.ExpiresAt) {
		t.Errorf("GetSteps: StartedAt, ExpiresAt = %v, %v; want %v, %v", got.StartedAt, got.ExpiresAt, now, req.ExpiresAt)
	}
	other := newStep(t, "charge")
	wantNoStep(t, ss, other, now)
}

// testStepFinish: FinishStep by the owner records the outcome (done or
// failed) for good: BeginStep of any owner, with Rerun or not, returns it and
// begins nothing; a second FinishStep, or one by another owner, is
// ErrLockLost and changes nothing.
func testStepFinish(t *testing.T, _ idem.Store, ss idem.StepStore) {
	for _, state := range []idem.StepState{idem.StepDone, idem.StepFailed} {
		t.Run(state.String(), func(t *testing.T) {
			st := newStep(t, "charge")
			now := time.Now()
			req := st.begin("own-"+randToken(), now, longTTL)
			mustBegin(t, ss, req)
			result := []byte(`{"id":"ch_1","amount":1250}`)
			if state == idem.StepFailed {
				result = []byte(`{"message":"card declined"}`)
			}
			wantLockLost(t, "FinishStep by another owner", ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, "not-the-owner", state, []byte(`{"x":1}`), now))
			if err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, req.Owner, state, result, now); err != nil {
				t.Fatalf("FinishStep: %v", err)
			}
			got := mustStep(t, ss, st, now)
			checkStep(t, "after FinishStep", &got, state, "", req.DerivedKey, result)
			wantLockLost(t, "a second FinishStep", ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, req.Owner, idem.StepDone, []byte(`{"again":true}`), now))
			wantLockLost(t, "AbandonStep of a finished step", ss.AbandonStep(ctxFor(t), st.scope, st.key, st.name, req.Owner, now))
			for _, rerun := range []bool{false, true} {
				next := st.begin("own-"+randToken(), now, longTTL)
				next.Rerun = rerun
				rec := mustNotBegin(t, ss, next)
				checkStep(t, fmt.Sprintf("BeginStep (rerun %v) of a finished step", rerun), rec, state, "", req.DerivedKey, result)
			}
			got = mustStep(t, ss, st, now)
			checkStep(t, "in the end", &got, state, "", req.DerivedKey, result)
		})
	}
}

// testStepAbandon: AbandonStep clears the owner and keeps the record started
// with its derived key and StartedAt; the next BeginStep, Rerun or not,
// begins it again with that derived key.
func testStepAbandon(t *testing.T, _ idem.Store, ss idem.StepStore) {
	st := newStep(t, "charge")
	now := time.Now()
	a := st.begin("own-a-"+randToken(), now, longTTL)
	mustBegin(t, ss, a)
	wantLockLost(t, "AbandonStep by another owner", ss.AbandonStep(ctxFor(t), st.scope, st.key, st.name, "not-the-owner", now))
	wantLockLost(t, "AbandonStep of a step never begun", ss.AbandonStep(ctxFor(t), st.scope, st.key, "never-begun", a.Owner, now))
	if err := ss.AbandonStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, now); err != nil {
		t.Fatalf("AbandonStep: %v", err)
	}
	got := mustStep(t, ss, st, now)
	checkStep(t, "after AbandonStep", &got, idem.StepStarted, "", a.DerivedKey, nil)
	wantLockLost(t, "FinishStep by the owner that abandoned it", ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, idem.StepDone, []byte(`1`), now))
	wantLockLost(t, "FinishStep with an empty owner", ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, "", idem.StepDone, []byte(`1`), now))
	later := now.Add(5 * time.Millisecond)
	b := st.begin("own-b-"+randToken(), later, longTTL) // Rerun false: an abandoned step is begun again whatever the policy
	rec := mustBegin(t, ss, b)
	checkStep(t, "BeginStep of an abandoned step", rec, idem.StepStarted, b.Owner, a.DerivedKey, nil)
	if !sameTime(rec.StartedAt, now) {
		t.Errorf("StartedAt = %v after the step was begun again, want the first %v", rec.StartedAt, now)
	}
	if err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, b.Owner, idem.StepDone, []byte(`"ok"`), later); err != nil {
		t.Fatalf("FinishStep by the new owner: %v", err)
	}
	got = mustStep(t, ss, st, later)
	checkStep(t, "finished by the new owner", &got, idem.StepDone, "", a.DerivedKey, []byte(`"ok"`))
}

// testStepRerun: a started step of another owner is taken over only with
// Rerun, keeping its derived key; the old owner is then fenced out of
// FinishStep and AbandonStep.
func testStepRerun(t *testing.T, _ idem.Store, ss idem.StepStore) {
	st := newStep(t, "charge")
	now := time.Now()
	a := st.begin("own-a-"+randToken(), now, longTTL)
	mustBegin(t, ss, a)
	b := st.begin("own-b-"+randToken(), now, longTTL)
	b.Rerun = true
	rec := mustBegin(t, ss, b)
	checkStep(t, "taken over with Rerun", rec, idem.StepStarted, b.Owner, a.DerivedKey, nil)
	wantLockLost(t, "FinishStep by the owner that was taken over", ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, idem.StepDone, []byte(`"a"`), now))
	wantLockLost(t, "AbandonStep by the owner that was taken over", ss.AbandonStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, now))
	if err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, b.Owner, idem.StepDone, []byte(`"b"`), now); err != nil {
		t.Fatalf("FinishStep by the owner that took over: %v", err)
	}
	got := mustStep(t, ss, st, now)
	checkStep(t, "finished", &got, idem.StepDone, "", a.DerivedKey, []byte(`"b"`))
}

// testStepRefuse: without Rerun, a started step of another owner stays its
// owner's: BeginStep begins nothing and returns it, and its owner can still
// finish it.
func testStepRefuse(t *testing.T, _ idem.Store, ss idem.StepStore) {
	st := newStep(t, "charge")
	now := time.Now()
	a := st.begin("own-a-"+randToken(), now, longTTL)
	mustBegin(t, ss, a)
	b := st.begin("own-b-"+randToken(), now, longTTL)
	rec := mustNotBegin(t, ss, b)
	checkStep(t, "BeginStep without Rerun of another owner's started step", rec, idem.StepStarted, a.Owner, a.DerivedKey, nil)
	if err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, idem.StepFailed, []byte(`{"message":"declined"}`), now); err != nil {
		t.Fatalf("FinishStep by the owner after a refused BeginStep: %v", err)
	}
	got := mustStep(t, ss, st, now)
	checkStep(t, "finished", &got, idem.StepFailed, "", a.DerivedKey, []byte(`{"message":"declined"}`))
}

// testStepOtherRequest: a live step record keeps the fingerprint of the
// request that wrote it, and a BeginStep with another fingerprint (the key
// released and reused for a different request) writes nothing — it does not
// take an abandoned or started record, nor move its expiry — and returns the
// record with its own fingerprint, began false, with and without Holder. The
// first request (its fingerprint) still begins and finishes it; a request
// without a fingerprint (a consumer's) is not told apart; a record that
// expired is a new one, with the new fingerprint.
func testStepOtherRequest(t *testing.T, s idem.Store, ss idem.StepStore) {
	const fpA = "v3:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	const fpB = "v3:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
	for _, holder := range []bool{false, true} {
		t.Run(fmt.Sprintf("holder=%v", holder), func(t *testing.T) {
			st := newStep(t, "charge")
			now := time.Now()
			// The owner of an execution: with Holder, the token of a claim of
			// the request record (released before the next request claims
			// it, as after an answer that was not kept).
			owner := func(fp string) string {
				if !holder {
					return "own-" + randToken()
				}
				c := st.claim(fp, now, time.Minute, longTTL)
				mustClaim(t, s, c)
				return c.Token
			}
			release := func(token string) {
				if holder {
					if err := s.Release(ctxFor(t), st.scope, st.key, token); err != nil {
						t.Fatalf("Release: %v", err)
					}
				}
			}
			begin := func(own, fp string, rerun bool, ttl time.Duration) idem.BeginStepRequest {
				r := st.begin(own, now, ttl)
				r.Holder, r.Rerun, r.Fingerprint = holder, rerun, fp
				return r
			}
			ownA := owner(fpA)
			a := begin(ownA, fpA, true, longTTL)
			rec := mustBegin(t, ss, a)
			if rec.Fingerprint != fpA {
				t.Errorf("BeginStep of a new step returned Fingerprint %q, want %q", rec.Fingerprint, fpA)
			}
			first := mustStep(t, ss, st, now)
			if first.Fingerprint != fpA {
				t.Errorf("GetSteps: Fingerprint %q, want the first request's %q", first.Fingerprint, fpA)
			}
			if err := ss.AbandonStep(ctxFor(t), st.scope, st.key, st.name, ownA, now); err != nil {
				t.Fatalf("AbandonStep: %v", err)
			}
			release(ownA)

			// Another request with the key (fpB, Rerun, a later expiry): the
			// record is never taken, nor its expiry moved.
			other := func(what string, state idem.StepState, stOwner string, result []byte) {
				t.Helper()
				ownB := owner(fpB)
				defer release(ownB)
				rec, began := beginStep(t, ss, begin(ownB, fpB, true, 2*longTTL))
				if began {
					t.Fatalf("%s: BeginStep by another request (fingerprint %s) began the first request's step (%+v)", what, fpB, rec)
				}
				checkStep(t, what, rec, state, stOwner, a.DerivedKey, result)
				if rec.Fingerprint != fpA {
					t.Errorf("%s: BeginStep by another request returned Fingerprint %q, want the first request's %q", what, rec.Fingerprint, fpA)
				}
				got := mustStep(t, ss, st, now)
				checkStep(t, what+" (GetSteps)", &got, state, stOwner, a.DerivedKey, result)
				if got.Fingerprint != fpA || !sameTime(got.ExpiresAt, first.ExpiresAt) {
					t.Errorf("%s: after another request's BeginStep the record has Fingerprint %q and ExpiresAt %v, want %q and %v (nothing written)", what, got.Fingerprint, got.ExpiresAt, fpA, first.ExpiresAt)
				}
				if !holder {
					// No fingerprint (a consumer's operation): not told apart.
					n := begin("own-"+randToken(), "", false, longTTL)
					if rec, began := beginStep(t, ss, n); (state == idem.StepStarted && stOwner == "") != began || rec.DerivedKey != a.DerivedKey {
						t.Errorf("%s: BeginStep without a fingerprint: began %v, record %+v", what, began, rec)
					} else if began {
						if err := ss.AbandonStep(ctxFor(t), st.scope, st.key, st.name, n.Owner, now); err != nil {
							t.Fatalf("AbandonStep: %v", err)
						}
					}
				}
			}
			other("abandoned", idem.StepStarted, "", nil)

			// The first request again: it takes its abandoned step; it
			// stays started under it after its answer was not kept
			// (StepAmbiguous, then a 5xx).
			ownA2 := owner(fpA)
			rec = mustBegin(t, ss, begin(ownA2, fpA, false, longTTL))
			checkStep(t, "the first request again", rec, idem.StepStarted, ownA2, a.DerivedKey, nil)
			release(ownA2)
			other("started by the first request", idem.StepStarted, ownA2, nil)

			// And again, with Rerun: it takes the step over and records it.
			ownA3 := owner(fpA)
			mustBegin(t, ss, begin(ownA3, fpA, true, longTTL))
			if err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, ownA3, idem.StepDone, []byte(`{"amount":10}`), now); err != nil {
				t.Fatalf("FinishStep by the first request: %v", err)
			}
			release(ownA3)
			other("done", idem.StepDone, "", []byte(`{"amount":10}`))
		})
	}
	t.Run("expired", func(t *testing.T) {
		const ttl = 300 * time.Millisecond
		st := newStep(t, "charge")
		now := time.Now()
		a := st.begin("own-a-"+randToken(), now, ttl)
		a.Fingerprint = fpA
		mustBegin(t, ss, a)
		time.Sleep(ttl + 50*time.Millisecond)
		later := time.Now()
		b := st.begin("own-b-"+randToken(), later, longTTL)
		b.Fingerprint = fpB
		rec := mustBegin(t, ss, b)
		checkStep(t, "BeginStep by another request after the first one's record expired", rec, idem.StepStarted, b.Owner, b.DerivedKey, nil)
		if got := mustStep(t, ss, st, later); got.Fingerprint != fpB {
			t.Errorf("an expired record begun anew has Fingerprint %q, want the new request's %q", got.Fingerprint, fpB)
		}
	})
}

// testStepOtherRequestFirst: with First, BeginStep looks at every live step
// record of the key: a step the first request never recorded is not begun
// for another request (another fingerprint) when any record of the key is
// the first request's — nothing is written, and the other record is
// returned, began false — with and without Holder. Without First the step is
// judged on its own record (absent: begun). The first request's own
// fingerprint, a request without one, a record without one (a consumer's)
// and an expired record refuse nothing.
func testStepOtherRequestFirst(t *testing.T, s idem.Store, ss idem.StepStore) {
	const fpA = "v3:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	const fpB = "v3:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
	for _, holder := range []bool{false, true} {
		t.Run(fmt.Sprintf("holder=%v", holder), func(t *testing.T) {
			a := newStep(t, "reserve")
			now := time.Now()
			owner := func(fp string) string {
				if !holder {
					return "own-" + randToken()
				}
				c := a.claim(fp, now, time.Minute, longTTL)
				mustClaim(t, s, c)
				return c.Token
			}
			release := func(token string) {
				if holder {
					if err := s.Release(ctxFor(t), a.scope, a.key, token); err != nil {
						t.Fatalf("Release: %v", err)
					}
				}
			}
			begin := func(name, own, fp string) idem.BeginStepRequest {
				r := stepOf{a.fixture, name}.begin(own, now, longTTL)
				r.Holder, r.Fingerprint, r.First = holder, fp, true
				return r
			}
			ownA := owner(fpA)
			first := mustBegin(t, ss, begin("reserve", ownA, fpA))
			if err := ss.FinishStep(ctxFor(t), a.scope, a.key, "reserve", ownA, idem.StepDone, []byte(`1`), now); err != nil {
				t.Fatalf("FinishStep: %v", err)
			}
			release(ownA)

			// Another request whose first step is one the first request
			// never recorded.
			ownB := owner(fpB)
			rec, began, err := ss.BeginStep(ctxFor(t), begin("ship", ownB, fpB))
			if err != nil {
				t.Fatalf("BeginStep(ship, First) by another request: %v", err)
			}
			if began || rec == nil {
				t.Fatalf("BeginStep(ship, First) by another request (fingerprint %s) while the key has the first request's step: began %v, record %+v; want began false and the first request's record", fpB, began, rec)
			}
			if rec.Name != "reserve" || rec.Fingerprint != fpA || rec.DerivedKey != first.DerivedKey || rec.State != idem.StepDone {
				t.Errorf("BeginStep(ship, First) by another request returned %+v, want the first request's record of reserve (done, fingerprint %s)", rec, fpA)
			}
			recs := getSteps(t, ss, a.fixture, now)
			if _, ok := recs["ship"]; ok || len(recs) != 1 {
				t.Errorf("after a refused BeginStep(ship, First) the key has steps %v, want reserve only (nothing written)", recs)
			}
			if got := recs["reserve"]; !sameTime(got.ExpiresAt, first.ExpiresAt) {
				t.Errorf("a refused BeginStep(ship, First) moved reserve's expiry from %v to %v", first.ExpiresAt, got.ExpiresAt)
			}
			release(ownB)

			// The first request itself: its second step begins.
			ownA2 := owner(fpA)
			mustBegin(t, ss, begin("ship", ownA2, fpA))
			if err := ss.AbandonStep(ctxFor(t), a.scope, a.key, "ship", ownA2, now); err != nil {
				t.Fatalf("AbandonStep: %v", err)
			}
			release(ownA2)

			if !holder {
				// No fingerprint (a consumer's): not told apart.
				n := begin("notify", "own-"+randToken(), "")
				mustBegin(t, ss, n)
				// A step whose own record has no fingerprint is refused too
				// while the key has the first request's.
				rec, began, err := ss.BeginStep(ctxFor(t), begin("notify", "own-"+randToken(), fpB))
				if err != nil {
					t.Fatalf("BeginStep(notify, First) by another request: %v", err)
				}
				if began || rec == nil || rec.Fingerprint != fpA || rec.Name == "notify" {
					t.Errorf("BeginStep(notify, First) by another request, notify recorded without a fingerprint and the key with the first request's steps: began %v, record %+v; want began false and a record of the first request", began, rec)
				}
				if got := getSteps(t, ss, a.fixture, now)["notify"]; got.Owner != n.Owner {
					t.Errorf("a refused BeginStep(notify, First) changed notify's record: %+v", got)
				}
				// Without First, a step is judged on its own record.
				b := begin("audit", "own-"+randToken(), fpB)
				b.First = false
				mustBegin(t, ss, b)
			}
		})
	}
	t.Run("unfingerprinted", func(t *testing.T) {
		a := newStep(t, "reserve")
		now := time.Now()
		r := a.begin("own-"+randToken(), now, longTTL)
		mustBegin(t, ss, r) // a record without fingerprint
		b := stepOf{a.fixture, "ship"}.begin("own-"+randToken(), now, longTTL)
		b.Fingerprint, b.First = fpB, true
		mustBegin(t, ss, b)
	})
	t.Run("expired", func(t *testing.T) {
		const ttl = 300 * time.Millisecond
		a := newStep(t, "reserve")
		now := time.Now()
		r := a.begin("own-"+randToken(), now, ttl)
		r.Fingerprint = fpA
		mustBegin(t, ss, r)
		time.Sleep(ttl + 50*time.Millisecond)
		later := time.Now()
		b := stepOf{a.fixture, "ship"}.begin("own-"+randToken(), later, longTTL)
		b.Fingerprint, b.First = fpB, true
		mustBegin(t, ss, b)
	})
}

// testStepHolderFence: with Holder, BeginStep begins only for the holder of
// the request record (in flight under Owner, not expired); otherwise it is
// ErrLockLost and writes nothing. After a takeover of the request record the
// old holder cannot begin a step; the new one can, and with Rerun takes the
// old holder's started step over.
func testStepHolderFence(t *testing.T, s idem.Store, ss idem.StepStore) {
	st := newStep(t, "charge")
	first := st.claim("v1:steps", time.Now(), shortLease, longTTL)
	mustClaim(t, s, first)
	now := time.Now()
	a := st.begin(first.Token, now, longTTL)
	a.Holder = true
	mustBegin(t, ss, a)

	stranger := stepOf{st.fixture, "ship"}.begin("tok-"+randToken(), now, longTTL)
	stranger.Holder = true
	_, _, err := ss.BeginStep(ctxFor(t), stranger)
	wantLockLost(t, "BeginStep with Holder by a token that does not hold the record", err)
	wantNoStep(t, ss, stepOf{st.fixture, "ship"}, now)

	absent := newStep(t, "charge").begin(first.Token, now, longTTL)
	absent.Holder = true
	_, _, err = ss.BeginStep(ctxFor(t), absent)
	wantLockLost(t, "BeginStep with Holder of an absent request record", err)

	time.Sleep(shortLease + 50*time.Millisecond)
	later := time.Now()
	taker := st.claim("v1:steps", later, time.Minute, longTTL)
	mustClaim(t, s, taker)
	old := stepOf{st.fixture, "ship"}.begin(first.Token, later, longTTL)
	old.Holder = true
	_, _, err = ss.BeginStep(ctxFor(t), old)
	wantLockLost(t, "BeginStep with Holder by the holder that was taken over", err)
	wantNoStep(t, ss, stepOf{st.fixture, "ship"}, later)

	b := st.begin(taker.Token, later, longTTL)
	b.Holder, b.Rerun = true, true
	rec := mustBegin(t, ss, b)
	checkStep(t, "the new holder took the step over", rec, idem.StepStarted, taker.Token, a.DerivedKey, nil)
	if err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, taker.Token, idem.StepDone, []byte(`"b"`), later); err != nil {
		t.Fatalf("FinishStep by the new holder: %v", err)
	}

	// A record no longer in flight fences every holder out.
	if err := s.Complete(ctxFor(t), st.scope, st.key, taker.Token, &idem.Response{Status: 201}, later, later.Add(longTTL)); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	done := stepOf{st.fixture, "after"}.begin(taker.Token, later, longTTL)
	done.Holder = true
	_, _, err = ss.BeginStep(ctxFor(t), done)
	wantLockLost(t, "BeginStep with Holder of a complete record", err)
	wantNoStep(t, ss, stepOf{st.fixture, "after"}, later)

	// An expired in-flight record fences its holder out too.
	ex := newStep(t, "charge")
	exClaim := ex.claim("v1:steps", time.Now(), time.Minute, 300*time.Millisecond)
	mustClaim(t, s, exClaim)
	time.Sleep(350 * time.Millisecond)
	late := ex.begin(exClaim.Token, time.Now(), longTTL)
	late.Holder = true
	_, _, err = ss.BeginStep(ctxFor(t), late)
	wantLockLost(t, "BeginStep with Holder of an expired request record", err)
}

// testStepHolderPastTTL: the Holder fence and Complete agree on a record
// whose first expiry (its claim's ExpiresAt) has passed while its lease is
// held — renewed by Extend, which raises the expiry to the lease: the holder
// begins and finishes steps past the TTL, as it completes the record; once
// the record is complete, or its lease and expiry have lapsed and another
// execution took it over, the old holder begins none, and cannot complete.
func testStepHolderPastTTL(t *testing.T, s idem.Store, ss idem.StepStore) {
	const (
		lease = 150 * time.Millisecond
		ttl   = 300 * time.Millisecond
		run   = 750 * time.Millisecond
	)
	for _, end := range []string{"complete", "takeover"} {
		t.Run(end, func(t *testing.T) {
			st := newStep(t, "charge")
			start := time.Now()
			c := st.claim("v1:long", start, lease, ttl)
			mustClaim(t, s, c)
			i := 0
			// Until run has passed and a step was begun past the expiry: on
			// a loaded machine one Extend can take longer than the rest of
			// run (CI saw i == 0 once), so the loop goes on, within a
			// bound, until it has proved something.
			for time.Since(start) < run || (i == 0 && time.Since(start) < 40*run) {
				time.Sleep(lease / 3)
				now := time.Now()
				if err := s.Extend(ctxFor(t), st.scope, st.key, c.Token, now, now.Add(lease)); err != nil {
					t.Fatalf("Extend at %v: %v", now.Sub(start), err)
				}
				if now.Sub(start) < ttl+lease/3 {
					continue // past the claim's expiry only
				}
				i++
				name := fmt.Sprintf("step-%d", i)
				req := stepOf{st.fixture, name}.begin(c.Token, now, longTTL)
				req.Holder = true
				rec, began, err := ss.BeginStep(ctxFor(t), req)
				if err != nil || !began {
					t.Fatalf("at %v (past the claim's expiry, lease held), the holder's BeginStep: began %v, %v; want began", now.Sub(start), began, err)
				}
				checkStep(t, "begun past the TTL", rec, idem.StepStarted, c.Token, req.DerivedKey, nil)
				if err := ss.FinishStep(ctxFor(t), st.scope, st.key, name, c.Token, idem.StepDone, []byte(`1`), now); err != nil {
					t.Fatalf("FinishStep past the TTL: %v", err)
				}
			}
			if i == 0 {
				t.Fatal("no step was begun past the claim's expiry; the test proved nothing")
			}
			after := stepOf{st.fixture, "after"}
			switch end {
			case "complete":
				done := time.Now()
				if err := s.Complete(ctxFor(t), st.scope, st.key, c.Token, &idem.Response{Status: 201}, done, done.Add(ttl)); err != nil {
					t.Fatalf("the holder's Complete past the TTL: %v", err)
				}
				req := after.begin(c.Token, done, longTTL)
				req.Holder = true
				_, _, err := ss.BeginStep(ctxFor(t), req)
				wantLockLost(t, "BeginStep with Holder once the record is complete", err)
			case "takeover":
				// The holder stops renewing: lease and expiry lapse, another
				// execution takes the record over.
				time.Sleep(lease + 50*time.Millisecond)
				later := time.Now()
				taker := st.claim("v1:long", later, time.Minute, longTTL)
				mustClaim(t, s, taker)
				req := after.begin(c.Token, later, longTTL)
				req.Holder = true
				_, _, err := ss.BeginStep(ctxFor(t), req)
				wantLockLost(t, "BeginStep with Holder by the holder taken over", err)
				wantLockLost(t, "Complete by the holder taken over", s.Complete(ctxFor(t), st.scope, st.key, c.Token, &idem.Response{Status: 201}, later, later.Add(ttl)))
				wantNoStep(t, ss, after, later)
				req = after.begin(taker.Token, later, longTTL)
				req.Holder = true
				mustBegin(t, ss, req)
				return
			}
			wantNoStep(t, ss, after, time.Now())
		})
	}
}

// testStepExpiry: a step record past its ExpiresAt counts as absent: GetSteps
// leaves it out, FinishStep and AbandonStep of it are ErrLockLost, and a
// BeginStep writes a new record with the new derived key (a key reused after
// its TTL is a new operation).
func testStepExpiry(t *testing.T, _ idem.Store, ss idem.StepStore) {
	const ttl = 300 * time.Millisecond
	for _, state := range []idem.StepState{idem.StepStarted, idem.StepDone} {
		t.Run(state.String(), func(t *testing.T) {
			st := newStep(t, "charge")
			now := time.Now()
			a := st.begin("own-a-"+randToken(), now, ttl)
			mustBegin(t, ss, a)
			if state == idem.StepDone {
				if err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, idem.StepDone, []byte(`"old"`), now); err != nil {
					t.Fatalf("FinishStep: %v", err)
				}
			}
			time.Sleep(ttl + 50*time.Millisecond)
			later := time.Now()
			wantNoStep(t, ss, st, later)
			if state == idem.StepStarted {
				wantLockLost(t, "FinishStep of an expired step", ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, idem.StepDone, []byte(`1`), later))
				wantLockLost(t, "AbandonStep of an expired step", ss.AbandonStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, later))
			}
			b := st.begin("own-b-"+randToken(), later, longTTL)
			rec := mustBegin(t, ss, b)
			checkStep(t, "BeginStep after the expiry", rec, idem.StepStarted, b.Owner, b.DerivedKey, nil)
			if !sameTime(rec.StartedAt, later) || !sameTime(rec.ExpiresAt, b.ExpiresAt) {
				t.Errorf("StartedAt, ExpiresAt = %v, %v; want the new record's %v, %v", rec.StartedAt, rec.ExpiresAt, later, b.ExpiresAt)
			}
			if state == idem.StepStarted {
				wantLockLost(t, "FinishStep by the expired record's owner", ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, idem.StepDone, []byte(`1`), later))
			}
		})
	}
}

// testStepExpiryMovedLater: BeginStep moves a live record's expiry to its
// ExpiresAt when that is later (a takeover's claim lives longer), never
// earlier; the record then outlives its first expiry.
func testStepExpiryMovedLater(t *testing.T, _ idem.Store, ss idem.StepStore) {
	const ttl = 400 * time.Millisecond
	st := newStep(t, "charge")
	now := time.Now()
	a := st.begin("own-a-"+randToken(), now, ttl)
	mustBegin(t, ss, a)
	if err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, idem.StepDone, []byte(`"kept"`), now); err != nil {
		t.Fatalf("FinishStep: %v", err)
	}
	shorter := st.begin("own-b-"+randToken(), now, ttl/2)
	rec := mustNotBegin(t, ss, shorter)
	if !sameTime(rec.ExpiresAt, a.ExpiresAt) {
		t.Errorf("ExpiresAt = %v after a BeginStep with an earlier expiry, want it kept at %v", rec.ExpiresAt, a.ExpiresAt)
	}
	longer := st.begin("own-c-"+randToken(), now, longTTL)
	rec = mustNotBegin(t, ss, longer)
	if !sameTime(rec.ExpiresAt, longer.ExpiresAt) {
		t.Errorf("ExpiresAt = %v after a BeginStep with a later expiry, want %v", rec.ExpiresAt, longer.ExpiresAt)
	}
	time.Sleep(ttl + 50*time.Millisecond)
	got := mustStep(t, ss, st, time.Now())
	checkStep(t, "past its first expiry", &got, idem.StepDone, "", a.DerivedKey, []byte(`"kept"`))
}

// testStepBeginRace: BeginStep of one new step by many owners at the same
// moment begins it exactly once, and every caller sees the one record's
// derived key; with one owner (one execution calling Step twice at once)
// too.
func testStepBeginRace(t *testing.T, _ idem.Store, ss idem.StepStore) {
	const n = 16
	const fp = "v3:aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	for _, c := range []struct{ sameOwner, first bool }{{false, false}, {true, false}, {false, true}} {
		sameOwner := c.sameOwner
		name := fmt.Sprintf("same owner %v", sameOwner)
		if c.first {
			// First, with a record of the same request already there: the
			// check of the key's other records decides nothing here.
			name = "first"
		}
		t.Run(name, func(t *testing.T) {
			st := newStep(t, "charge")
			now := time.Now()
			owner := "own-" + randToken()
			if c.first {
				r := stepOf{st.fixture, "reserve"}.begin("own-"+randToken(), now, longTTL)
				r.Fingerprint = fp
				mustBegin(t, ss, r)
			}
			var (
				wg    sync.WaitGroup
				start = make(chan struct{})
				mu    sync.Mutex
				began int
				keys  = map[string]int{}
				errs  []error
			)
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					req := st.begin(owner, now, longTTL)
					if !sameOwner {
						req.Owner = fmt.Sprintf("own-%d-%s", i, randToken())
					}
					if c.first {
						req.First, req.Fingerprint = true, fp
					}
					<-start
					rec, ok, err := ss.BeginStep(ctxFor(t), req)
					mu.Lock()
					defer mu.Unlock()
					if err != nil {
						errs = append(errs, err)
						return
					}
					if ok {
						began++
					}
					keys[rec.DerivedKey]++
				}()
			}
			close(start)
			wg.Wait()
			if len(errs) > 0 {
				t.Fatalf("%d of %d concurrent BeginSteps failed: %v", len(errs), n, errs[0])
			}
			if began != 1 || len(keys) != 1 {
				t.Fatalf("%d concurrent BeginSteps of one new step: %d began, %d derived keys seen (%v); want exactly 1 and 1", n, began, len(keys), keys)
			}
			got := mustStep(t, ss, st, now)
			if _, ok := keys[got.DerivedKey]; !ok || got.State != idem.StepStarted {
				t.Fatalf("the stored step is %+v, want started with the derived key every caller saw", got)
			}
		})
	}
	t.Run("first, another request", func(t *testing.T) {
		// n BeginSteps with First of another request, of n new names, at
		// once, while the key has a record of the first request: none
		// begins, nothing is written.
		const other = "v3:bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
		st := newStep(t, "reserve")
		now := time.Now()
		r := st.begin("own-"+randToken(), now, longTTL)
		r.Fingerprint = fp
		mustBegin(t, ss, r)
		var (
			wg    sync.WaitGroup
			start = make(chan struct{})
			mu    sync.Mutex
			began int
			errs  []error
		)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req := stepOf{st.fixture, fmt.Sprintf("ship-%d", i)}.begin(fmt.Sprintf("own-%d-%s", i, randToken()), now, longTTL)
				req.First, req.Fingerprint = true, other
				<-start
				rec, ok, err := ss.BeginStep(ctxFor(t), req)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case err != nil:
					errs = append(errs, err)
				case ok || rec == nil || rec.Fingerprint != fp:
					began++
				}
			}()
		}
		close(start)
		wg.Wait()
		if len(errs) > 0 {
			t.Fatalf("%d of %d concurrent BeginSteps failed: %v", len(errs), n, errs[0])
		}
		if began != 0 {
			t.Fatalf("%d concurrent BeginSteps with First of another request: %d began or did not return the first request's record; want none", n, began)
		}
		if recs := getSteps(t, ss, st.fixture, now); len(recs) != 1 {
			t.Fatalf("after %d refused BeginSteps the key has steps %v, want reserve only", n, recs)
		}
	})
}

// testStepSettle: SettleStep writes an outcome into a step whatever its
// owner, or deletes it (state 0); it is ErrNotFound for a step that is absent
// or expired.
func testStepSettle(t *testing.T, _ idem.Store, ss idem.StepStore) {
	st := newStep(t, "charge")
	now := time.Now()
	a := st.begin("own-a-"+randToken(), now, longTTL)
	mustBegin(t, ss, a)
	if err := ss.SettleStep(ctxFor(t), st.scope, st.key, st.name, idem.StepDone, []byte(`{"id":"ch_op"}`), now); err != nil {
		t.Fatalf("SettleStep done: %v", err)
	}
	got := mustStep(t, ss, st, now)
	checkStep(t, "settled done", &got, idem.StepDone, "", a.DerivedKey, []byte(`{"id":"ch_op"}`))
	wantLockLost(t, "FinishStep by the owner after the step was settled", ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, a.Owner, idem.StepFailed, []byte(`1`), now))
	rec := mustNotBegin(t, ss, func() idem.BeginStepRequest {
		r := st.begin("own-b-"+randToken(), now, longTTL)
		r.Rerun = true
		return r
	}())
	checkStep(t, "BeginStep of a settled step", rec, idem.StepDone, "", a.DerivedKey, []byte(`{"id":"ch_op"}`))
	if err := ss.SettleStep(ctxFor(t), st.scope, st.key, st.name, idem.StepFailed, []byte(`{"message":"refunded"}`), now); err != nil {
		t.Fatalf("SettleStep failed over done: %v", err)
	}
	got = mustStep(t, ss, st, now)
	checkStep(t, "settled failed", &got, idem.StepFailed, "", a.DerivedKey, []byte(`{"message":"refunded"}`))
	if err := ss.SettleStep(ctxFor(t), st.scope, st.key, st.name, 0, nil, now); err != nil {
		t.Fatalf("SettleStep 0 (forget): %v", err)
	}
	wantNoStep(t, ss, st, now)
	if err := ss.SettleStep(ctxFor(t), st.scope, st.key, st.name, idem.StepDone, []byte(`1`), now); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("SettleStep of a forgotten step = %v, want ErrNotFound", err)
	}
	c := st.begin("own-c-"+randToken(), now, longTTL)
	rec = mustBegin(t, ss, c)
	checkStep(t, "BeginStep after the step was forgotten", rec, idem.StepStarted, c.Owner, c.DerivedKey, nil)

	ex := newStep(t, "charge")
	mustBegin(t, ss, ex.begin("own-"+randToken(), time.Now(), 300*time.Millisecond))
	time.Sleep(350 * time.Millisecond)
	if err := ss.SettleStep(ctxFor(t), ex.scope, ex.key, ex.name, idem.StepDone, []byte(`1`), time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("SettleStep of an expired step = %v, want ErrNotFound", err)
	}
}

// testGetStepsOrder: GetSteps returns the live steps of one operation, and
// only of it, ordered by StartedAt (not by name).
func testGetStepsOrder(t *testing.T, _ idem.Store, ss idem.StepStore) {
	f := newFixture(t)
	now := time.Now()
	names := []string{"charge", "reserve", "a-ship", "notify"}
	for i, name := range names {
		at := now.Add(time.Duration(i) * 10 * time.Millisecond)
		mustBegin(t, ss, stepOf{f, name}.begin("own-"+randToken(), at, longTTL))
	}
	mustBegin(t, ss, stepOf{fixture{f.scope, f.key + "x"}, "zz"}.begin("own-"+randToken(), now, longTTL))
	mustBegin(t, ss, stepOf{fixture{f.scope + "x", f.key}, "zz"}.begin("own-"+randToken(), now, longTTL))
	recs, err := ss.GetSteps(ctxFor(t), f.scope, f.key, now.Add(time.Second))
	if err != nil {
		t.Fatalf("GetSteps: %v", err)
	}
	var got []string
	for _, r := range recs {
		got = append(got, r.Name)
	}
	if strings.Join(got, ",") != strings.Join(names, ",") {
		t.Fatalf("GetSteps = %v, want %v (ordered by StartedAt, this operation's only)", got, names)
	}
	none, err := ss.GetSteps(ctxFor(t), f.scope, "no-such-key", now)
	if err != nil || len(none) != 0 {
		t.Fatalf("GetSteps of an operation without steps = %v, %v; want none", none, err)
	}
}

// testDeleteExpiredSteps: DeleteExpiredSteps deletes expired step records in
// batches of at most limit and never a live one (a self-expiring store
// reports 0 and its expired records are gone by themselves).
func testDeleteExpiredSteps(t *testing.T, s idem.Store, ss idem.StepStore) {
	f := newFixture(t)
	now := time.Now()
	const expired = 5
	for i := range expired {
		mustBegin(t, ss, stepOf{f, fmt.Sprintf("old-%d", i)}.begin("own-"+randToken(), now, 300*time.Millisecond))
	}
	live := stepOf{f, "live"}
	mustBegin(t, ss, live.begin("own-"+randToken(), now, longTTL))
	time.Sleep(350 * time.Millisecond)
	later := time.Now()
	self := false
	if se, ok := s.(SelfExpiring); ok && se.ExpiresRecordsItself() {
		self = true
	}
	total := 0
	for range 10 {
		n, err := ss.DeleteExpiredSteps(ctxFor(t), later, 2)
		if err != nil {
			t.Fatalf("DeleteExpiredSteps: %v", err)
		}
		if n < 0 || n > 2 {
			t.Fatalf("DeleteExpiredSteps(limit 2) = %d", n)
		}
		if self && n != 0 {
			t.Fatalf("a self-expiring store's DeleteExpiredSteps = %d, want 0", n)
		}
		total += n
		if n < 2 {
			break
		}
	}
	if !self && total != expired {
		t.Fatalf("DeleteExpiredSteps deleted %d records in all, want the %d expired ones", total, expired)
	}
	// The expired records are gone: not even a view at an earlier now shows
	// them (a self-expiring store's backend deleted them).
	steps := getSteps(t, ss, f, now)
	if len(steps) != 1 {
		t.Fatalf("after the sweep GetSteps at the records' own start shows %d steps (%v), want only the live one", len(steps), steps)
	}
	got := mustStep(t, ss, live, later)
	if got.State != idem.StepStarted {
		t.Fatalf("the live step is %+v after the sweep", got)
	}
}

// hostileStepNames are names a store must keep apart and whole: the
// characters of SQL, LIKE patterns, Redis globs and key separators.
var hostileStepNames = []string{
	"a", "a:b", "a:b:c", "a\\b", "a%", "a_", "%", "_", "*", "?", "[a]", "{tag}", "'; DROP TABLE x; --",
	`"quoted"`, "a/b", "a.b", "A", "~!@#$^&()+=|<>,`", strings.Repeat("n", idem.MaxStepNameLength),
	strings.Repeat("n", idem.MaxStepNameLength-1) + "m",
}

// testStepHostileNames: every hostile name is a step of its own; and (scope,
// key, name) triples whose concatenations collide are different steps.
func testStepHostileNames(t *testing.T, _ idem.Store, ss idem.StepStore) {
	f := newFixture(t)
	now := time.Now()
	for _, name := range hostileStepNames {
		st := stepOf{f, name}
		req := st.begin("own-"+randToken(), now, longTTL)
		mustBegin(t, ss, req)
		if err := ss.FinishStep(ctxFor(t), f.scope, f.key, name, req.Owner, idem.StepDone, []byte(fmt.Sprintf("%q", name)), now); err != nil {
			t.Fatalf("FinishStep(%q): %v", name, err)
		}
	}
	steps := getSteps(t, ss, f, now)
	if len(steps) != len(hostileStepNames) {
		t.Fatalf("GetSteps returned %d steps, want %d", len(steps), len(hostileStepNames))
	}
	for _, name := range hostileStepNames {
		r, ok := steps[name]
		if !ok || string(r.Result) != fmt.Sprintf("%q", name) {
			t.Errorf("step %q = %+v, %v; want its own result", name, r, ok)
		}
	}
	// Triples that a store joining scope, key and name with ":" would confuse,
	// with the longest key and scope the middleware passes.
	base := "s-" + randomID(t)
	longKey := strings.Repeat("k", idem.DefaultMaxKeyLength-1)
	longScope := base + strings.Repeat("s", idem.MaxStoredScopeLength-len(base))
	triples := [][3]string{
		{base, "b:c", "d"}, {base, "b", "c:d"}, {base + ":b", "c", "d"},
		{longScope, longKey + "1", "n"}, {longScope, longKey + "2", "n"},
		{longScope[:len(longScope)-1] + "t", longKey + "1", "n"},
	}
	for i, tr := range triples {
		st := stepOf{fixture{tr[0], tr[1]}, tr[2]}
		req := st.begin("own-"+randToken(), now, longTTL)
		mustBegin(t, ss, req)
		if err := ss.FinishStep(ctxFor(t), tr[0], tr[1], tr[2], req.Owner, idem.StepDone, []byte(fmt.Sprint(i)), now); err != nil {
			t.Fatalf("FinishStep%q: %v", tr, err)
		}
	}
	for i, tr := range triples {
		steps := getSteps(t, ss, fixture{tr[0], tr[1]}, now)
		if len(steps) != 1 || string(steps[tr[2]].Result) != fmt.Sprint(i) {
			t.Errorf("the steps of (%q, %q) = %v; want only %q with result %d", tr[0], tr[1], steps, tr[2], i)
		}
	}
}

// testStepLargeResult: results are kept byte for byte, whatever their size
// and spacing (a store must not normalise them as JSON), up to 512 KiB.
func testStepLargeResult(t *testing.T, _ idem.Store, ss idem.StepStore) {
	f := newFixture(t)
	now := time.Now()
	big := []byte(`{"blob":"` + strings.Repeat("é\\u0000\\\"x", 512<<10/12) + `"}`)
	results := map[string][]byte{
		"spacing": []byte(`{"b" : 1,  "a":[1, 2 ,3], "a": 2}`),
		"unicode": []byte(`"\u2028 ☃ \ud83d\ude00 ` + "\U0001F600" + `"`),
		"null":    []byte(`null`),
		"big":     big,
	}
	for name, result := range results {
		st := stepOf{f, name}
		req := st.begin("own-"+randToken(), now, longTTL)
		mustBegin(t, ss, req)
		if err := ss.FinishStep(ctxFor(t), f.scope, f.key, name, req.Owner, idem.StepDone, result, now); err != nil {
			t.Fatalf("FinishStep(%s, %d bytes): %v", name, len(result), err)
		}
		// The caller may reuse its buffer once FinishStep returned.
		for i := range result {
			result[i] = 'X'
		}
		result = nil
	}
	want := map[string][]byte{
		"spacing": []byte(`{"b" : 1,  "a":[1, 2 ,3], "a": 2}`),
		"unicode": []byte(`"\u2028 ☃ \ud83d\ude00 ` + "\U0001F600" + `"`),
		"null":    []byte(`null`),
		"big":     []byte(`{"blob":"` + strings.Repeat("é\\u0000\\\"x", 512<<10/12) + `"}`),
	}
	steps := getSteps(t, ss, f, now)
	for name, w := range want {
		got := steps[name]
		checkStep(t, "result "+name, &got, idem.StepDone, "", got.DerivedKey, w)
		rec := mustNotBegin(t, ss, stepOf{f, name}.begin("own-"+randToken(), now, longTTL))
		checkStep(t, "BeginStep's record of "+name, rec, idem.StepDone, "", got.DerivedKey, w)
	}
}

// testStepHugeResult: a result larger than a store keeps (20 MiB) is kept
// whole or refused with idem.ErrFieldTooLarge, changing nothing: the step
// stays started under its owner, never recorded cut short.
func testStepHugeResult(t *testing.T, _ idem.Store, ss idem.StepStore) {
	st := newStep(t, "charge")
	now := time.Now()
	req := st.begin("own-"+randToken(), now, longTTL)
	mustBegin(t, ss, req)
	huge := []byte(`"` + strings.Repeat("h", 20<<20) + `"`)
	err := ss.FinishStep(ctxFor(t), st.scope, st.key, st.name, req.Owner, idem.StepDone, huge, now)
	got := mustStep(t, ss, st, now)
	switch {
	case err == nil:
		if got.State != idem.StepDone || !bytes.Equal(got.Result, huge) {
			t.Fatalf("FinishStep of %d bytes succeeded, and the step is %v with %d bytes", len(huge), got.State, len(got.Result))
		}
	case errors.Is(err, idem.ErrFieldTooLarge):
		checkStep(t, "after a refused FinishStep", &got, idem.StepStarted, req.Owner, req.DerivedKey, nil)
	default:
		t.Fatalf("FinishStep of %d bytes: %v; want it kept or refused with idem.ErrFieldTooLarge", len(huge), err)
	}
}

// stepWithin runs BeginStep and FinishStep of st under owner within a
// deadline, on parent: the context the open transaction's BeginTx or
// BeginLocked returned, as the middleware passes the handler's context to
// Step. A store whose step records wait for a lock the open transaction holds
// deadlocks here; one that writes them in the transaction the context carries
// loses them with its rollback.
func stepWithin(t *testing.T, parent context.Context, ss idem.StepStore, req idem.BeginStepRequest) error {
	ctx, cancel := context.WithTimeout(parent, 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		_, began, err := ss.BeginStep(ctx, req)
		if err == nil && !began {
			err = errors.New("BeginStep of a new step did not begin")
		}
		if err == nil {
			err = ss.FinishStep(ctx, req.Scope, req.Key, req.Name, req.Owner, idem.StepDone, []byte(`"charged"`), req.Now)
		}
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(12 * time.Second):
		return errors.New("BeginStep and FinishStep did not return within 12 s while a transaction of the same store was open (a deadlock on the store's write lock?)")
	}
}

// testStepDuringTx: a step is recorded while the handler's business
// transaction (TxStore.BeginTx) is open, with the transaction's context,
// without waiting for it and outside it: it survives the rollback.
func testStepDuringTx(t *testing.T, s idem.Store, ss idem.StepStore) {
	ts, ok := s.(idem.TxStore)
	if !ok {
		t.Skip("the store is not an idem.TxStore")
	}
	st := newStep(t, "charge")
	now := time.Now()
	claim := st.claim("v1:steps", now, time.Minute, longTTL)
	mustClaim(t, s, claim)
	ctx, tx, err := ts.BeginTx(ctxFor(t))
	if err != nil {
		t.Fatalf("BeginTx: %v", err)
	}
	req := st.begin(claim.Token, now, longTTL)
	req.Holder = true
	err = stepWithin(t, ctx, ss, req)
	_ = tx.Rollback(ctx)
	if err != nil {
		t.Fatalf("a step while a transaction is open: %v", err)
	}
	got := mustStep(t, ss, st, now)
	checkStep(t, "the step, after the transaction rolled back", &got, idem.StepDone, "", req.DerivedKey, []byte(`"charged"`))
}

// testStepDuringSingleTx: a step is recorded while the single-transaction
// flow's locked transaction (SingleTxStore.BeginLocked) is open, with the
// transaction's context, without waiting for it and outside it: it survives
// the rollback.
func testStepDuringSingleTx(t *testing.T, s idem.Store, ss idem.StepStore) {
	ls, ok := s.(idem.SingleTxStore)
	if !ok {
		t.Skip("the store is not an idem.SingleTxStore")
	}
	st := newStep(t, "charge")
	now := time.Now()
	ctx, tx, rec, err := ls.BeginLocked(ctxFor(t), st.scope, st.key, now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked = %+v, %v", rec, err)
	}
	req := st.begin("own-"+randToken(), now, longTTL)
	err = stepWithin(t, ctx, ss, req)
	if err == nil {
		// A second step while the lock is still held.
		err = stepWithin(t, ctx, ss, stepOf{st.fixture, "ship"}.begin(req.Owner, now, longTTL))
	}
	_ = tx.Rollback(ctx)
	if err != nil {
		t.Fatalf("a step while the single-transaction flow's transaction is open: %v", err)
	}
	steps := getSteps(t, ss, st.fixture, now)
	if len(steps) != 2 || steps["charge"].State != idem.StepDone || steps["ship"].State != idem.StepDone {
		t.Fatalf("after the transaction rolled back the steps are %v, want charge and ship done", steps)
	}
	wantNotFound(t, s, st.fixture, now)
}
