// Package steptest holds the step-record checks every store's own tests run
// against its real database (sqlitestore, pgstore, mysqlstore, redisstore):
// BeginStep's decisions, concurrent BeginSteps of one step, the Holder fence
// after a takeover, expiry, AbandonStep, SettleStep, DeleteExpiredSteps and
// hostile input. The conformance suite (storetest) checks the contract too;
// these are the stores' own regression tests, kept stdlib-only so that every
// store module can import them.
package steptest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// Store is what the checks need: a store that keeps step records.
type Store interface {
	idem.Store
	idem.StepStore
}

// Options tune Run.
type Options struct {
	// Concurrency is how many goroutines begin one step at once in the
	// concurrency check. Defaults to 16.
	Concurrency int
	// Resolution is the store's time resolution; the checks' clock readings
	// are multiples of it. Defaults to a millisecond.
	Resolution time.Duration
	// NoDeleteExpired: the store's step records expire by themselves
	// (DeleteExpiredSteps returns 0, nil), so the janitor check only checks
	// that expired records count as absent.
	NoDeleteExpired bool
}

// Run runs every check as a subtest of t against the store newStore returns
// (a fresh table or key prefix per call).
func Run(t *testing.T, newStore func(t *testing.T) Store, opts Options) {
	if opts.Concurrency <= 0 {
		opts.Concurrency = 16
	}
	if opts.Resolution <= 0 {
		opts.Resolution = time.Millisecond
	}
	for _, c := range []struct {
		name string
		fn   func(t *testing.T, s Store, o Options)
	}{
		{"Lifecycle", lifecycle},
		{"ConcurrentBegin", concurrentBegin},
		{"ConcurrentBeginHolder", concurrentBeginHolder},
		{"HolderFenceAfterTakeover", holderFence},
		{"RefuseAndRerun", refuseAndRerun},
		{"AbandonKeepsDerivedKey", abandon},
		{"FinalFailure", finalFailure},
		{"Expiry", expiry},
		{"ExpiryMovesLater", expiryMovesLater},
		{"Settle", settle},
		{"DeleteExpiredSteps", deleteExpired},
		{"Janitor", janitor},
		{"HostileInput", hostile},
		{"ScopesAndKeysApart", apart},
	} {
		t.Run(c.name, func(t *testing.T) {
			c.fn(t, newStore(t), opts)
		})
	}
}

func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return c
}

// Rand returns n random bytes as hex.
func Rand(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// base is a clock reading of the store's resolution.
func base(o Options) time.Time {
	return time.Now().Truncate(o.Resolution)
}

type fix struct {
	scope, key string
	now        time.Time
}

func newFix(o Options) fix {
	return fix{scope: "tenant-" + Rand(4), key: "key-" + Rand(8), now: base(o)}
}

func (f fix) begin(name, owner string, rerun bool, now time.Time) idem.BeginStepRequest {
	return idem.BeginStepRequest{
		Scope: f.scope, Key: f.key, Name: name, Owner: owner, Rerun: rerun,
		DerivedKey: "idem_" + Rand(16), Now: now, ExpiresAt: f.now.Add(time.Hour),
	}
}

// claim claims f's request record under a fresh token at now with lease.
func (f fix) claim(t *testing.T, s Store, now time.Time, lease time.Duration) string {
	t.Helper()
	tok := "tok-" + Rand(8)
	_, ok, err := s.Claim(ctx(t), idem.ClaimRequest{
		Scope: f.scope, Key: f.key, Fingerprint: "v1:steps", Token: tok,
		Now: now, LeaseUntil: now.Add(lease), ExpiresAt: f.now.Add(time.Hour),
	})
	if err != nil || !ok {
		t.Fatalf("Claim at %v = %v, %v; want claimed", now, ok, err)
	}
	return tok
}

func mustBegin(t *testing.T, s Store, req idem.BeginStepRequest, wantBegan bool) *idem.StepRecord {
	t.Helper()
	rec, began, err := s.BeginStep(ctx(t), req)
	if err != nil {
		t.Fatalf("BeginStep(%s, owner %s) = %v", req.Name, req.Owner, err)
	}
	if began != wantBegan {
		t.Fatalf("BeginStep(%s, owner %s) began = %v, want %v (record %+v)", req.Name, req.Owner, began, wantBegan, rec)
	}
	if rec == nil || rec.Name != req.Name || rec.Scope != req.Scope || rec.Key != req.Key {
		t.Fatalf("BeginStep(%s) returned record %+v", req.Name, rec)
	}
	return rec
}

func steps(t *testing.T, s Store, f fix, now time.Time) []idem.StepRecord {
	t.Helper()
	recs, err := s.GetSteps(ctx(t), f.scope, f.key, now)
	if err != nil {
		t.Fatalf("GetSteps: %v", err)
	}
	return recs
}

func lifecycle(t *testing.T, s Store, o Options) {
	f := newFix(o)
	req := f.begin("charge", "A", true, f.now)
	rec := mustBegin(t, s, req, true)
	if rec.State != idem.StepStarted || rec.Owner != "A" || rec.DerivedKey != req.DerivedKey || rec.Result != nil ||
		!rec.StartedAt.Equal(f.now) || !rec.ExpiresAt.Equal(req.ExpiresAt) {
		t.Fatalf("new record = %+v, want started by A with the request's derived key and times", rec)
	}
	// The same owner again: a programming error the middleware reports; the
	// store only says it did not begin.
	again := mustBegin(t, s, f.begin("charge", "A", true, f.now), false)
	if again.State != idem.StepStarted || again.Owner != "A" || again.DerivedKey != req.DerivedKey {
		t.Fatalf("BeginStep of owner's own started step = %+v", again)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "B", idem.StepDone, []byte(`{}`), f.now); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("FinishStep by a non-owner = %v, want ErrLockLost", err)
	}
	result := []byte(`{"id":"ch_1","amount":1200}`)
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "A", idem.StepDone, result, f.now.Add(time.Second)); err != nil {
		t.Fatalf("FinishStep: %v", err)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "A", idem.StepDone, result, f.now.Add(time.Second)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("second FinishStep = %v, want ErrLockLost (the record is no longer started)", err)
	}
	if err := s.AbandonStep(ctx(t), f.scope, f.key, "charge", "A", f.now); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("AbandonStep of a done step = %v, want ErrLockLost", err)
	}
	for _, rerun := range []bool{false, true} {
		done := mustBegin(t, s, f.begin("charge", "B", rerun, f.now.Add(2*time.Second)), false)
		if done.State != idem.StepDone || string(done.Result) != string(result) || done.DerivedKey != req.DerivedKey {
			t.Fatalf("BeginStep of a done step (rerun %v) = %+v, want done with the result and the first derived key", rerun, done)
		}
	}
	mustBegin(t, s, f.begin("ship", "A", true, f.now.Add(3*time.Second)), true)
	got := steps(t, s, f, f.now.Add(4*time.Second))
	if len(got) != 2 || got[0].Name != "charge" || got[1].Name != "ship" || got[0].State != idem.StepDone ||
		string(got[0].Result) != string(result) || got[1].State != idem.StepStarted || got[1].Result != nil ||
		got[0].DerivedKey != req.DerivedKey || got[1].DerivedKey == req.DerivedKey {
		t.Fatalf("GetSteps = %+v, want charge (done) then ship (started)", got)
	}
	if got := steps(t, s, fix{scope: f.scope, key: f.key + "x"}, f.now); len(got) != 0 {
		t.Fatalf("GetSteps of another key = %+v", got)
	}
	// An empty result is kept as an empty result, not as none.
	mustBegin(t, s, f.begin("empty", "A", true, f.now), true)
	if err := s.FinishStep(ctx(t), f.scope, f.key, "empty", "A", idem.StepDone, []byte{}, f.now); err != nil {
		t.Fatal(err)
	}
	if r := mustBegin(t, s, f.begin("empty", "B", true, f.now), false); r.State != idem.StepDone || len(r.Result) != 0 {
		t.Fatalf("done step with an empty result = %+v", r)
	}
}

// concurrentBegin: many owners begin one fresh step at the same moment;
// exactly one begins it, and every one sees its derived key.
func concurrentBegin(t *testing.T, s Store, o Options) {
	for round := range 3 {
		f := newFix(o)
		n := o.Concurrency
		var (
			wg      sync.WaitGroup
			release = make(chan struct{})
			mu      sync.Mutex
			began   []string
			keys    = map[string]int{}
			errs    []error
		)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req := f.begin("charge", fmt.Sprintf("owner-%d", i), false, f.now)
				<-release
				rec, ok, err := s.BeginStep(context.Background(), req)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, err)
					return
				}
				if ok {
					began = append(began, req.Owner)
					if rec.Owner != req.Owner || rec.DerivedKey != req.DerivedKey {
						errs = append(errs, fmt.Errorf("began record %+v is not %s's", rec, req.Owner))
					}
				}
				keys[rec.DerivedKey]++
			}()
		}
		close(release)
		wg.Wait()
		if len(errs) > 0 {
			t.Fatalf("round %d: %d of %d BeginSteps failed: %v", round, len(errs), n, errs[0])
		}
		if len(began) != 1 || len(keys) != 1 {
			t.Fatalf("round %d: %d concurrent BeginSteps: began %v, derived keys seen %v; want exactly one began and one key", round, n, began, keys)
		}
		got := steps(t, s, f, f.now)
		if len(got) != 1 || got[0].Owner != began[0] {
			t.Fatalf("round %d: records %+v, want one of %s", round, got, began[0])
		}
	}
}

// concurrentBeginHolder: the holder's BeginSteps of many steps at once, and
// of one step from many goroutines, all pass the fence; one began.
func concurrentBeginHolder(t *testing.T, s Store, o Options) {
	f := newFix(o)
	tok := f.claim(t, s, f.now, time.Minute)
	n := o.Concurrency
	var wg sync.WaitGroup
	release := make(chan struct{})
	var mu sync.Mutex
	beganOne, beganMany := 0, 0
	var errs []error
	for i := range n {
		wg.Add(2)
		run := func(name string, count *int) {
			defer wg.Done()
			req := f.begin(name, tok, false, f.now.Add(time.Millisecond))
			req.Holder = true
			<-release
			_, ok, err := s.BeginStep(context.Background(), req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			} else if ok {
				*count++
			}
		}
		go run("one", &beganOne)
		go run(fmt.Sprintf("step-%02d", i), &beganMany)
	}
	close(release)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("%d BeginSteps of the holder failed: %v", len(errs), errs[0])
	}
	if beganOne != 1 || beganMany != n {
		t.Fatalf("holder's concurrent BeginSteps: %d began the shared step (want 1), %d of %d distinct steps began", beganOne, beganMany, n)
	}
	if got := steps(t, s, f, f.now.Add(time.Second)); len(got) != n+1 {
		t.Fatalf("%d records, want %d", len(got), n+1)
	}
}

// holderFence: after a takeover of the request record, the old holder's
// BeginStep fails with ErrLockLost and writes nothing; its FinishStep of a
// step the new holder re-ran fails too.
func holderFence(t *testing.T, s Store, o Options) {
	f := newFix(o)
	a := f.claim(t, s, f.now, time.Second)
	req := f.begin("charge", a, true, f.now.Add(100*time.Millisecond))
	req.Holder = true
	first := mustBegin(t, s, req, true)

	// Not the holder: another token, or no record at all.
	bad := f.begin("other", "nobody", true, f.now.Add(200*time.Millisecond))
	bad.Holder = true
	if _, _, err := s.BeginStep(ctx(t), bad); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("BeginStep with Holder under a token that holds nothing = %v, want ErrLockLost", err)
	}
	none := newFix(o)
	nreq := none.begin("charge", "A", true, none.now)
	nreq.Holder = true
	if _, _, err := s.BeginStep(ctx(t), nreq); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("BeginStep with Holder and no request record = %v, want ErrLockLost", err)
	}
	if got := steps(t, s, none, none.now); len(got) != 0 {
		t.Fatalf("a fenced-out BeginStep wrote %+v", got)
	}

	// The lease lapses; B takes the record over.
	b := f.claim(t, s, f.now.Add(2*time.Second), time.Minute)
	late := f.begin("late", a, true, f.now.Add(3*time.Second))
	late.Holder = true
	if _, _, err := s.BeginStep(ctx(t), late); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("old holder's BeginStep after a takeover = %v, want ErrLockLost", err)
	}
	rerun := f.begin("charge", a, true, f.now.Add(3*time.Second))
	rerun.Holder = true
	if _, _, err := s.BeginStep(ctx(t), rerun); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("old holder's BeginStep of its own step after a takeover = %v, want ErrLockLost", err)
	}
	got := steps(t, s, f, f.now.Add(3*time.Second))
	if len(got) != 1 || got[0].Name != "charge" || got[0].Owner != a {
		t.Fatalf("records after fenced-out BeginSteps: %+v, want only charge of the old holder", got)
	}
	// The new holder re-runs the step with the same derived key.
	nb := f.begin("charge", b, true, f.now.Add(4*time.Second))
	nb.Holder = true
	rec := mustBegin(t, s, nb, true)
	if rec.Owner != b || rec.DerivedKey != first.DerivedKey || !rec.StartedAt.Equal(first.StartedAt) {
		t.Fatalf("takeover of the step = %+v, want B's with the first derived key and start", rec)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", a, idem.StepDone, []byte(`1`), f.now.Add(5*time.Second)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("old owner's FinishStep after the takeover = %v, want ErrLockLost", err)
	}
	if err := s.AbandonStep(ctx(t), f.scope, f.key, "charge", a, f.now.Add(5*time.Second)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("old owner's AbandonStep after the takeover = %v, want ErrLockLost", err)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", b, idem.StepDone, []byte(`2`), f.now.Add(5*time.Second)); err != nil {
		t.Fatalf("new owner's FinishStep: %v", err)
	}
	// A completed request record fences too: it is no longer in flight.
	if err := s.Complete(ctx(t), f.scope, f.key, b, &idem.Response{Status: 201, Body: []byte("ok")}, f.now.Add(6*time.Second), f.now.Add(time.Hour)); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	after := f.begin("after", b, true, f.now.Add(7*time.Second))
	after.Holder = true
	if _, _, err := s.BeginStep(ctx(t), after); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("BeginStep with Holder on a completed record = %v, want ErrLockLost", err)
	}
	// An expired request record fences.
	g := newFix(o)
	tok := g.claim(t, s, g.now, time.Hour)
	exp := g.begin("x", tok, true, g.now.Add(2*time.Hour))
	exp.Holder = true
	exp.ExpiresAt = g.now.Add(3 * time.Hour)
	if _, _, err := s.BeginStep(ctx(t), exp); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("BeginStep with Holder on an expired record = %v, want ErrLockLost", err)
	}
}

func refuseAndRerun(t *testing.T, s Store, o Options) {
	f := newFix(o)
	first := mustBegin(t, s, f.begin("charge", "A", false, f.now), true)
	r := mustBegin(t, s, f.begin("charge", "B", false, f.now.Add(time.Second)), false)
	if r.State != idem.StepStarted || r.Owner != "A" || r.DerivedKey != first.DerivedKey {
		t.Fatalf("refusing BeginStep of A's started step = %+v, want A's record unchanged", r)
	}
	r = mustBegin(t, s, f.begin("charge", "B", true, f.now.Add(2*time.Second)), true)
	if r.State != idem.StepStarted || r.Owner != "B" || r.DerivedKey != first.DerivedKey || !r.StartedAt.Equal(first.StartedAt) {
		t.Fatalf("rerunning BeginStep = %+v, want B's with A's derived key and start", r)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "A", idem.StepDone, nil, f.now); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("FinishStep of the overtaken owner = %v, want ErrLockLost", err)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "B", idem.StepDone, []byte(`"x"`), f.now); err != nil {
		t.Fatal(err)
	}
}

func abandon(t *testing.T, s Store, o Options) {
	f := newFix(o)
	first := mustBegin(t, s, f.begin("charge", "A", false, f.now), true)
	if err := s.AbandonStep(ctx(t), f.scope, f.key, "charge", "B", f.now); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("AbandonStep by a non-owner = %v, want ErrLockLost", err)
	}
	if err := s.AbandonStep(ctx(t), f.scope, f.key, "charge", "A", f.now.Add(time.Second)); err != nil {
		t.Fatalf("AbandonStep: %v", err)
	}
	got := steps(t, s, f, f.now.Add(time.Second))
	if len(got) != 1 || got[0].State != idem.StepStarted || got[0].Owner != "" || got[0].DerivedKey != first.DerivedKey {
		t.Fatalf("abandoned record = %+v, want started, without owner, with the derived key", got)
	}
	if err := s.AbandonStep(ctx(t), f.scope, f.key, "charge", "", f.now); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("AbandonStep with owner \"\" of an abandoned step = %v, want ErrLockLost", err)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "", idem.StepDone, nil, f.now); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("FinishStep with owner \"\" of an abandoned step = %v, want ErrLockLost", err)
	}
	// Whatever Rerun, the next execution begins it with the same derived key.
	r := mustBegin(t, s, f.begin("charge", "B", false, f.now.Add(2*time.Second)), true)
	if r.Owner != "B" || r.DerivedKey != first.DerivedKey || r.State != idem.StepStarted {
		t.Fatalf("BeginStep of an abandoned step = %+v, want B's with the first derived key", r)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "A", idem.StepDone, nil, f.now); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("FinishStep of the abandoning owner = %v, want ErrLockLost", err)
	}
}

func finalFailure(t *testing.T, s Store, o Options) {
	f := newFix(o)
	mustBegin(t, s, f.begin("charge", "A", true, f.now), true)
	msg := []byte(`{"message":"card declined"}`)
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "A", idem.StepFailed, msg, f.now); err != nil {
		t.Fatal(err)
	}
	r := mustBegin(t, s, f.begin("charge", "B", true, f.now.Add(time.Second)), false)
	if r.State != idem.StepFailed || string(r.Result) != string(msg) {
		t.Fatalf("BeginStep of a failed step = %+v, want failed with the message", r)
	}
	for _, st := range []idem.StepState{0, idem.StepStarted, 9} {
		mustBegin(t, s, f.begin(fmt.Sprintf("bad-%d", st), "A", true, f.now), true)
		if err := s.FinishStep(ctx(t), f.scope, f.key, fmt.Sprintf("bad-%d", st), "A", st, nil, f.now); err == nil {
			t.Fatalf("FinishStep with state %d succeeded", st)
		}
	}
}

func expiry(t *testing.T, s Store, o Options) {
	f := newFix(o)
	req := f.begin("charge", "A", true, f.now)
	req.ExpiresAt = f.now.Add(time.Minute)
	first := mustBegin(t, s, req, true)
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "A", idem.StepDone, []byte(`1`), f.now.Add(time.Minute-o.Resolution)); err != nil {
		t.Fatalf("FinishStep just before expiry: %v", err)
	}
	at := f.now.Add(time.Minute)
	if got := steps(t, s, f, at); len(got) != 0 {
		t.Fatalf("GetSteps at the expiry = %+v, want none", got)
	}
	if got := steps(t, s, f, at.Add(-o.Resolution)); len(got) != 1 {
		t.Fatalf("GetSteps just before the expiry = %+v, want one", got)
	}
	if err := s.SettleStep(ctx(t), f.scope, f.key, "charge", idem.StepDone, nil, at); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("SettleStep of an expired record = %v, want ErrNotFound", err)
	}
	// A reuse of the key after its TTL: a new operation, new derived key.
	again := f.begin("charge", "B", false, at)
	again.ExpiresAt = at.Add(time.Hour)
	r := mustBegin(t, s, again, true)
	if r.State != idem.StepStarted || r.Owner != "B" || r.DerivedKey != again.DerivedKey || r.DerivedKey == first.DerivedKey ||
		r.Result != nil || !r.StartedAt.Equal(at) || !r.ExpiresAt.Equal(again.ExpiresAt) {
		t.Fatalf("BeginStep over an expired record = %+v, want a fresh record of B", r)
	}
	// Expired started records of other owners are not theirs to finish.
	g := newFix(o)
	q := g.begin("s", "A", true, g.now)
	q.ExpiresAt = g.now.Add(time.Second)
	mustBegin(t, s, q, true)
	if err := s.FinishStep(ctx(t), g.scope, g.key, "s", "A", idem.StepDone, nil, g.now.Add(time.Second)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("FinishStep of an expired record = %v, want ErrLockLost", err)
	}
	if err := s.AbandonStep(ctx(t), g.scope, g.key, "s", "A", g.now.Add(2*time.Second)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("AbandonStep of an expired record = %v, want ErrLockLost", err)
	}
}

func expiryMovesLater(t *testing.T, s Store, o Options) {
	f := newFix(o)
	req := f.begin("charge", "A", true, f.now)
	req.ExpiresAt = f.now.Add(time.Minute)
	mustBegin(t, s, req, true)
	// An earlier expiry leaves it; a later one moves it, also when the step
	// does not begin.
	earlier := f.begin("charge", "A", true, f.now.Add(time.Second))
	earlier.ExpiresAt = f.now.Add(30 * time.Second)
	if r := mustBegin(t, s, earlier, false); !r.ExpiresAt.Equal(req.ExpiresAt) {
		t.Fatalf("expiry after an earlier request = %v, want %v", r.ExpiresAt, req.ExpiresAt)
	}
	later := f.begin("charge", "B", false, f.now.Add(2*time.Second))
	later.ExpiresAt = f.now.Add(10 * time.Minute)
	if r := mustBegin(t, s, later, false); !r.ExpiresAt.Equal(later.ExpiresAt) || r.Owner != "A" {
		t.Fatalf("record after a later expiry = %+v, want A's until %v", r, later.ExpiresAt)
	}
	if got := steps(t, s, f, f.now.Add(5*time.Minute)); len(got) != 1 || !got[0].ExpiresAt.Equal(later.ExpiresAt) {
		t.Fatalf("GetSteps after the first expiry = %+v, want the record until %v", got, later.ExpiresAt)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "A", idem.StepDone, nil, f.now.Add(5*time.Minute)); err != nil {
		t.Fatalf("FinishStep after the first expiry, before the moved one: %v", err)
	}
}

func settle(t *testing.T, s Store, o Options) {
	f := newFix(o)
	mustBegin(t, s, f.begin("charge", "A", false, f.now), true)
	if err := s.SettleStep(ctx(t), f.scope, f.key, "charge", idem.StepDone, []byte(`{"id":"ch_9"}`), f.now); err != nil {
		t.Fatalf("SettleStep done: %v", err)
	}
	if r := mustBegin(t, s, f.begin("charge", "B", true, f.now), false); r.State != idem.StepDone || string(r.Result) != `{"id":"ch_9"}` {
		t.Fatalf("settled record = %+v", r)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "charge", "A", idem.StepDone, nil, f.now); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("owner's FinishStep after SettleStep = %v, want ErrLockLost", err)
	}
	if err := s.SettleStep(ctx(t), f.scope, f.key, "charge", idem.StepFailed, []byte(`{"message":"no"}`), f.now); err != nil {
		t.Fatalf("SettleStep failed: %v", err)
	}
	if got := steps(t, s, f, f.now); len(got) != 1 || got[0].State != idem.StepFailed || string(got[0].Result) != `{"message":"no"}` {
		t.Fatalf("records after SettleStep failed: %+v", got)
	}
	if err := s.SettleStep(ctx(t), f.scope, f.key, "charge", 0, nil, f.now); err != nil {
		t.Fatalf("SettleStep forget: %v", err)
	}
	if got := steps(t, s, f, f.now); len(got) != 0 {
		t.Fatalf("records after forgetting: %+v", got)
	}
	for _, st := range []idem.StepState{0, idem.StepDone} {
		if err := s.SettleStep(ctx(t), f.scope, f.key, "charge", st, nil, f.now); !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("SettleStep(%d) of a missing record = %v, want ErrNotFound", st, err)
		}
	}
	mustBegin(t, s, f.begin("charge", "C", false, f.now), true)
	if err := s.SettleStep(ctx(t), f.scope, f.key, "charge", idem.StepStarted, nil, f.now); err == nil || errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("SettleStep to started = %v, want an error", err)
	}
}

func deleteExpired(t *testing.T, s Store, o Options) {
	f := newFix(o)
	// Far in the past, so that other tests' records on the same table are not
	// touched and these are the only expired ones at cut.
	old := f.now.Add(-1000 * time.Hour)
	for i := range 5 {
		req := f.begin(fmt.Sprintf("s%d", i), "A", true, old)
		req.ExpiresAt = old.Add(time.Duration(i+1) * time.Minute)
		mustBegin(t, s, req, true)
	}
	live := f.begin("live", "A", true, f.now)
	mustBegin(t, s, live, true)
	if o.NoDeleteExpired {
		n, err := s.DeleteExpiredSteps(ctx(t), f.now, 100)
		if err != nil || n != 0 {
			t.Fatalf("DeleteExpiredSteps = %d, %v; want 0, nil", n, err)
		}
		return
	}
	cut := old.Add(3 * time.Minute) // s0, s1, s2 expired
	n, err := s.DeleteExpiredSteps(ctx(t), cut, 2)
	if err != nil || n != 2 {
		t.Fatalf("DeleteExpiredSteps(limit 2) = %d, %v; want 2", n, err)
	}
	n, err = s.DeleteExpiredSteps(ctx(t), cut, 100)
	if err != nil || n != 1 {
		t.Fatalf("second DeleteExpiredSteps = %d, %v; want 1", n, err)
	}
	if n, err := s.DeleteExpiredSteps(ctx(t), cut, 0); err != nil && n != 0 {
		t.Fatalf("DeleteExpiredSteps(limit 0) = %d, %v", n, err)
	}
	if got := steps(t, s, f, old); len(got) != 3 || got[0].Name != "s3" || got[1].Name != "s4" || got[2].Name != "live" {
		t.Fatalf("records left (at the old clock) = %+v, want s3, s4, live", got)
	}
	if got := steps(t, s, f, f.now); len(got) != 1 || got[0].Name != "live" {
		t.Fatalf("live records = %+v", got)
	}
}

func hostile(t *testing.T, s Store, o Options) {
	f := newFix(o)
	for name, req := range map[string]idem.BeginStepRequest{
		"NUL in name":  f.begin("char\x00ge", "A", true, f.now),
		"empty name":   f.begin("", "A", true, f.now),
		"NUL in owner": f.begin("charge", "A\x00B", true, f.now),
		"NUL in derived key": func() idem.BeginStepRequest {
			r := f.begin("charge", "A", true, f.now)
			r.DerivedKey = "idem_\x00"
			return r
		}(),
		"empty derived key":   func() idem.BeginStepRequest { r := f.begin("charge", "A", true, f.now); r.DerivedKey = ""; return r }(),
		"name over the limit": f.begin(strings.Repeat("n", idem.MaxStepNameLength+1), "A", true, f.now),
	} {
		if _, _, err := s.BeginStep(ctx(t), req); err == nil {
			t.Errorf("BeginStep with %s succeeded", name)
		} else if name == "name over the limit" && !errors.Is(err, idem.ErrFieldTooLarge) {
			t.Errorf("BeginStep with %s = %v, want ErrFieldTooLarge", name, err)
		}
	}
	if got := steps(t, s, f, f.now); len(got) != 0 {
		t.Fatalf("refused BeginSteps wrote %+v", got)
	}
	if err := s.FinishStep(ctx(t), f.scope, f.key, "a\x00", "A", idem.StepDone, nil, f.now); err == nil || errors.Is(err, idem.ErrLockLost) {
		t.Errorf("FinishStep with a NUL in the name = %v, want a refusal", err)
	}
	if err := s.SettleStep(ctx(t), f.scope, f.key, "a\x00", idem.StepDone, nil, f.now); err == nil || errors.Is(err, idem.ErrNotFound) {
		t.Errorf("SettleStep with a NUL in the name = %v, want a refusal", err)
	}
	// The longest name, quotes, and bytes that mean something to SQL or Lua
	// are names like any other.
	long := strings.Repeat("x", idem.MaxStepNameLength)
	odd := []string{long, `'; DROP TABLE x; --`, `"quoted"`, `a\b`, "%_*?[]{}", "x y"}
	for i, name := range odd {
		req := f.begin(name, "A", true, f.now.Add(time.Duration(i)*o.Resolution))
		mustBegin(t, s, req, true)
		res := []byte("\x00\xff binary result \x00")
		if err := s.FinishStep(ctx(t), f.scope, f.key, name, "A", idem.StepDone, res, f.now); err != nil {
			t.Fatalf("FinishStep(%q): %v", name, err)
		}
		if r := mustBegin(t, s, f.begin(name, "B", true, f.now), false); string(r.Result) != string(res) {
			t.Fatalf("result of %q = %q, want %q", name, r.Result, res)
		}
	}
	if got := steps(t, s, f, f.now); len(got) != len(odd) {
		t.Fatalf("%d records, want %d", len(got), len(odd))
	}
}

// apart: steps of one name under other scopes and keys are other records.
func apart(t *testing.T, s Store, o Options) {
	f := newFix(o)
	g := fix{scope: f.scope, key: f.key + "-2", now: f.now}
	h := fix{scope: f.scope + "-2", key: f.key, now: f.now}
	for _, x := range []fix{f, g, h} {
		mustBegin(t, s, x.begin("charge", "A", false, f.now), true)
	}
	if err := s.FinishStep(ctx(t), g.scope, g.key, "charge", "A", idem.StepDone, []byte(`1`), f.now); err != nil {
		t.Fatal(err)
	}
	for _, x := range []fix{f, h} {
		if got := steps(t, s, x, f.now); len(got) != 1 || got[0].State != idem.StepStarted {
			t.Fatalf("records of %s/%s: %+v", x.scope, x.key, got)
		}
	}
}

// janitor: idem.Janitor's sweep deletes the store's expired step records
// with its expired key records, in batches, and leaves live ones.
func janitor(t *testing.T, s Store, o Options) {
	f := newFix(o)
	old := f.now.Add(-2000 * time.Hour)
	for i := range 7 {
		req := f.begin(fmt.Sprintf("s%d", i), "A", true, old)
		req.ExpiresAt = old.Add(time.Minute)
		mustBegin(t, s, req, true)
	}
	mustBegin(t, s, f.begin("live", "A", true, f.now), true)
	j := &idem.Janitor{Store: s, BatchSize: 3, NowFunc: func() time.Time { return old.Add(time.Hour) }}
	n, err := j.Sweep(ctx(t))
	if err != nil {
		t.Fatalf("Sweep: %v", err)
	}
	want := 7
	if o.NoDeleteExpired {
		want = 0
	}
	if n != want {
		t.Fatalf("Sweep deleted %d, want %d", n, want)
	}
	if o.NoDeleteExpired {
		return
	}
	if got := steps(t, s, f, old); len(got) != 1 || got[0].Name != "live" {
		t.Fatalf("records after the sweep (at the old clock): %+v, want live only", got)
	}
}

// Bench measures, per iteration, one step's life as Step lives it: a first
// BeginStep (fenced on the request record, which the benchmark claimed), its
// FinishStep, and the BeginStep of a retry that finds it done (the replay).
// Each iteration is a fresh step name of one claimed request, so the table
// grows by b.N rows.
func Bench(b *testing.B, s Store) {
	c := context.Background()
	now := time.Now()
	scope, key, tok := "bench", "key-"+Rand(8), "tok-"+Rand(8)
	if _, ok, err := s.Claim(c, idem.ClaimRequest{Scope: scope, Key: key, Fingerprint: "v1:b", Token: tok,
		Now: now, LeaseUntil: now.Add(time.Hour), ExpiresAt: now.Add(2 * time.Hour)}); err != nil || !ok {
		b.Fatalf("Claim: %v %v", ok, err)
	}
	result := []byte(`{"id":"ch_3MmlLrLkdIwHu7ix0snN0B15","amount":1200,"currency":"eur"}`)
	b.ReportAllocs()
	b.ResetTimer()
	for i := range b.N {
		name := fmt.Sprintf("step-%d", i)
		req := idem.BeginStepRequest{Scope: scope, Key: key, Name: name, Owner: tok, Holder: true, Rerun: true,
			DerivedKey: "idem_" + Rand(16), Now: now, ExpiresAt: now.Add(2 * time.Hour)}
		if _, began, err := s.BeginStep(c, req); err != nil || !began {
			b.Fatalf("BeginStep: %v %v", began, err)
		}
		if err := s.FinishStep(c, scope, key, name, tok, idem.StepDone, result, now); err != nil {
			b.Fatalf("FinishStep: %v", err)
		}
		if rec, began, err := s.BeginStep(c, req); err != nil || began || rec.State != idem.StepDone {
			b.Fatalf("replay BeginStep: %v %v %v", rec, began, err)
		}
	}
}
