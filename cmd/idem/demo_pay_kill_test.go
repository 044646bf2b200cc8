package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/orders/fakepay"
)

// The proof of issue 27 on the reference service: the demo, charging every
// new order as the step "charge", is SIGKILLed at every boundary of a
// request, restarted, and the request retried with the same key until its
// answer is final; then the charges at the provider and the orders in the
// database are counted.

// The boundaries a request crosses, in order.
const (
	killBeforeCall   = "before-call"     // the step is begun; the provider has not acted
	killWhileAnswer  = "while-answering" // the provider charged; its answer is on its way
	killAfterRecord  = "after-record"    // the charge is recorded; the order is not committed
	killAfterCommit  = "after-commit"    // the order and its answer are committed
	killRetryWithin  = 90 * time.Second  // how long the retries of one request may take
	killReachTimeout = 60 * time.Second  // how long the demo may take to reach a boundary
)

var killBoundaries = []string{killBeforeCall, killWhileAnswer, killAfterRecord, killAfterCommit}

// stepsOf returns the live step records of key (scope t1) in db's store.
func stepsOf(t *testing.T, db payDB, key string) []idem.StepRecord {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	h, err := dbopen.Open(ctx, dbopen.Options{DB: db.db})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	ss, ok := h.Store.(idem.StepStore)
	if !ok {
		t.Fatalf("the %s store (%T) keeps no step records", db.name, h.Store)
	}
	recs, err := ss.GetSteps(ctx, idem.StoredScope("t1"), key, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	return recs
}

// stepDone reports whether key's step "charge" is recorded done.
func stepDone(t *testing.T, db payDB, key string) bool {
	t.Helper()
	for _, r := range stepsOf(t, db, key) {
		if r.Name == "charge" && r.State == idem.StepDone {
			return true
		}
	}
	return false
}

// waitStepDone waits until key's step "charge" is recorded done.
func waitStepDone(t *testing.T, db payDB, key string) {
	t.Helper()
	deadline := time.Now().Add(killReachTimeout)
	for !stepDone(t, db, key) {
		if time.Now().After(deadline) {
			t.Fatalf("the charge of %s was not recorded as a done step within %v: %+v", key, killReachTimeout, stepsOf(t, db, key))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// killRun is one request killed at a boundary and retried on a new demo.
type killRun struct {
	cart, key string
	final     httpAnswer // the retries' final answer
	demo      *demoProc  // the restarted demo
}

// killAndRetry starts a demo on db charging at p with args, sends one order,
// kills the demo (SIGKILL) when the request reaches boundary, starts another
// with args and retries the order with the same key until the answer is
// final (or is the unknown outcome of the refuse policy).
func killAndRetry(t *testing.T, db payDB, p *fakepay.Provider, boundary string, args ...string) killRun {
	t.Helper()
	r := killRun{cart: "c_" + strings.ReplaceAll(boundary, "-", "_") + "_" + cliRandHex(4), key: "kill-" + cliRandHex(8)}
	first := args
	if boundary == killAfterRecord {
		// The order is inserted after the step, then the transaction sleeps:
		// the kill lands between the recorded charge and the commit.
		first = append(append([]string{}, args...), "--handler-delay", "10m")
	}
	d := startPayDemo(t, db, p, first...)
	var hold *fakepay.Hold
	switch boundary {
	case killBeforeCall:
		hold = p.HoldNext(fakepay.BeforeCharge)
	case killWhileAnswer:
		hold = p.HoldNext(fakepay.AfterCharge)
	}
	answer := sendAsync(d.URL, r.key, payOrder(r.cart))
	switch boundary {
	case killBeforeCall, killWhileAnswer:
		select {
		case <-hold.Reached():
		case a := <-answer:
			t.Fatalf("the order was answered (%d %s) before it reached the provider's %s hold", a.Status, a.Body, boundary)
		case <-time.After(killReachTimeout):
			t.Fatalf("no charge reached the provider within %v", killReachTimeout)
		}
	case killAfterRecord:
		waitStepDone(t, db, r.key)
		if n := len(db.orders(t, r.cart)); n != 0 {
			t.Fatalf("%d orders committed while the handler sleeps in its transaction", n)
		}
	case killAfterCommit:
		a := <-answer
		if a.Status != 201 {
			t.Fatalf("the order before the kill: %d %s, want 201", a.Status, a.Body)
		}
	}
	d.kill(t)
	r.demo = startPayDemo(t, db, p, args...)
	r.final = retryFinal(t, r.demo, r.key, payOrder(r.cart), killRetryWithin)
	return r
}

// TestDemoPaymentKillHonoured: with a provider that honours Idempotency-Key,
// a kill at any boundary ends, after the retries, in exactly one charge and
// one order carrying it; after the charge is recorded, the provider sees no
// second call.
func TestDemoPaymentKillHonoured(t *testing.T) {
	t.Parallel()
	payStores(t, func(t *testing.T, db payDB) {
		p := fakepay.Start(fakepay.HonoursKeys)
		t.Cleanup(p.Close)
		for _, flow := range [][]string{nil, {"--flow", "claim-complete", "--lease", "1s"}} {
			for _, b := range killBoundaries {
				killHonoured(t, db, p, b, flow...)
			}
		}
	})
}

// killHonoured is one boundary of TestDemoPaymentKillHonoured.
func killHonoured(t *testing.T, db payDB, p *fakepay.Provider, b string, args ...string) {
	t.Helper()
	r := killAndRetry(t, db, p, b, args...)
	checkOneChargeOneOrder(t, db, p, r.cart, r.final)
	calls := len(p.CallsFor(r.cart))
	switch b {
	case killAfterRecord, killAfterCommit:
		// The recovery point, not the provider's dedupe, saves it.
		if calls != 1 {
			t.Fatalf("%s %v: the provider saw %d calls, want 1: the recorded charge must not be asked for again", b, args, calls)
		}
	default:
		if calls != 2 {
			t.Fatalf("%s %v: the provider saw %d calls, want 2 (the killed one and the retry, with one key)", b, args, calls)
		}
	}
	t.Logf("%s %v: 1 charge, 1 order, %d provider call(s) with one derived key, final %d", b, args, calls, r.final.Status)
}

// TestDemoPaymentKillIgnored: with a provider that ignores Idempotency-Key,
// the default policy (rerun) charges twice exactly when the kill lands while
// the provider is answering (it acted, its answer was lost, the retry runs the
// step again); everywhere else one charge. The refuse policy turns that window
// (and the one before the call, which the demo cannot tell from it) into an
// unknown outcome, which idem resolve settles: then one charge.
func TestDemoPaymentKillIgnored(t *testing.T) {
	t.Parallel()
	payStores(t, func(t *testing.T, db payDB) {
		p := fakepay.Start(fakepay.IgnoresKeys)
		t.Cleanup(p.Close)
		for _, b := range killBoundaries {
			r := killAndRetry(t, db, p, b)
			charges, ords, calls := p.ChargesFor(r.cart), db.orders(t, r.cart), len(p.CallsFor(r.cart))
			want := 1
			if b == killWhileAnswer {
				want = 2 // the window the rerun policy leaves open
			}
			if len(charges) != want || len(ords) != 1 {
				t.Fatalf("rerun, %s: %d charges and %d orders, want %d and 1", b, len(charges), len(ords), want)
			}
			if got := chargeIDOf(t, r.final); got != charges[len(charges)-1].ID {
				t.Fatalf("rerun, %s: the order carries %q, want the last charge %q", b, got, charges[len(charges)-1].ID)
			}
			if (b == killAfterRecord || b == killAfterCommit) && calls != 1 {
				t.Fatalf("rerun, %s: %d provider calls, want 1", b, calls)
			}
			t.Logf("rerun, %s: %d charge(s), 1 order, %d call(s)", b, len(charges), calls)
		}

		refuse := []string{"--payment-unknown", "refuse", "--lease", "1s"}
		for _, b := range killBoundaries {
			r := killAndRetry(t, db, p, b, refuse...)
			switch b {
			case killBeforeCall, killWhileAnswer:
				if r.final.Status != 502 || r.final.code() != "payment_unknown" || r.final.replayed() {
					t.Fatalf("refuse, %s: %d %s, want 502 payment_unknown", b, r.final.Status, r.final.Body)
				}
				charges := p.ChargesFor(r.cart)
				calls := len(p.CallsFor(r.cart))
				if n := len(db.orders(t, r.cart)); n != 0 || calls != 1 {
					t.Fatalf("refuse, %s: %d orders and %d calls after the unknown outcome, want 0 and 1 (no second call)", b, n, calls)
				}
				// Later retries hear the same until an operator settles the charge.
				if a := retryFinal(t, r.demo, r.key, payOrder(r.cart), killRetryWithin); a.code() != "payment_unknown" {
					t.Fatalf("refuse, %s: a later retry got %d %s, want payment_unknown", b, a.Status, a.Body)
				}
				// The operator looks the charge up at the provider: found
				// (while answering) → --done with it; none (before the call)
				// → --forget, and the next retry charges afresh.
				settle := []string{"--forget"}
				if len(charges) == 1 {
					settle = []string{"--done", fmt.Sprintf(`{"id":%q}`, charges[0].ID)}
				} else if len(charges) != 0 {
					t.Fatalf("refuse, %s: %d charges", b, len(charges))
				}
				// idem inspect shows the step begun and never recorded, with
				// the key the provider was called with.
				_, out, _ := runIdem(t, db.dir, nil, "inspect", "--db", db.db, "--scope", "t1", r.key)
				if call := p.CallsFor(r.cart)[0]; !strings.Contains(out, `"charge" started`) || !strings.Contains(out, call.Key) {
					t.Fatalf("refuse, %s: idem inspect does not show the begun charge with derived key %s:\n%s", b, call.Key, out)
				}
				settleStep(t, db, r.key, settle...)
				a := retryFinal(t, r.demo, r.key, payOrder(r.cart), killRetryWithin)
				keys := 1
				if settle[0] == "--forget" {
					keys = 2 // forgotten: the step ran afresh with a new derived key
				}
				checkCharged(t, db, p, r.cart, a, keys)
				t.Logf("refuse, %s: %d %s, settled with %v, then 201 with 1 charge, %d call(s)", b, r.final.Status, r.final.code(), settle, len(p.CallsFor(r.cart)))
			default:
				checkOneChargeOneOrder(t, db, p, r.cart, r.final)
				if calls := len(p.CallsFor(r.cart)); calls != 1 {
					t.Fatalf("refuse, %s: %d provider calls, want 1", b, calls)
				}
				t.Logf("refuse, %s: 1 charge, 1 order, 1 call", b)
			}
		}
	})
}

// killPoints is how many randomised kill points TestDemoPaymentKillRandom
// runs per store: IDEM_KILL_POINTS, 20 unless set (200 by hand).
func killPoints(t *testing.T) int {
	if v := os.Getenv("IDEM_KILL_POINTS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			t.Fatalf("IDEM_KILL_POINTS=%q: give a positive whole number", v)
		}
		return n
	}
	return 20
}

// TestDemoPaymentKillRandom kills the demo at random moments of a charged
// order (the provider answering after a random delay, the transaction
// sleeping a random time after the insert), restarts it and retries until
// the answer is final, IDEM_KILL_POINTS times per store and provider:
//   - honoured (the provider honours Idempotency-Key, default policy): no
//     double charge, no order without its charge, no charge without its
//     order, no second call after a recorded charge;
//   - ignored-rerun (the provider ignores keys, default policy): double
//     charges, if any, only after kills while the provider was answering
//     (it acted, nothing was recorded);
//   - ignored-refuse (--payment-unknown refuse): no double charge; unknown
//     outcomes, if any, only after kills before the charge was recorded,
//     settled with idem resolve --step, after which the order is made.
func TestDemoPaymentKillRandom(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name   string
		mode   fakepay.Mode
		refuse bool
	}{{"honoured", fakepay.HonoursKeys, false}, {"ignored-rerun", fakepay.IgnoresKeys, false}, {"ignored-refuse", fakepay.IgnoresKeys, true}} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			payStores(t, func(t *testing.T, db payDB) { killRandom(t, db, c.mode, c.refuse) })
		})
	}
}

// killRandom is one store and provider of TestDemoPaymentKillRandom.
func killRandom(t *testing.T, db payDB, mode fakepay.Mode, refuse bool) {
	p := fakepay.Start(mode)
	t.Cleanup(p.Close)
	n := killPoints(t)
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 27))
	var handlerDelay time.Duration
	args := func() []string {
		handlerDelay = time.Duration(rng.IntN(150)) * time.Millisecond
		a := []string{"--handler-delay", handlerDelay.String()}
		if refuse {
			a = append(a, "--payment-unknown", "refuse", "--lease", "1s")
		}
		return a
	}
	d := startPayDemo(t, db, p, args()...)
	windows, doubles, unknowns := map[string]int{}, map[string]int{}, map[string]int{}
	var orphanOrders, orphanCharges, secondCalls int
	for i := range n {
		cart, key := fmt.Sprintf("c_rand_%d_%s", i, cliRandHex(3)), "rand-"+cliRandHex(8)
		providerDelay := time.Duration(rng.IntN(120)) * time.Millisecond
		p.SetDelay(providerDelay)
		answer := sendAsync(d.URL, key, payOrder(cart))
		// Somewhere in the request: its own work takes a few ms more than
		// the two delays.
		time.Sleep(time.Duration(rng.Int64N(int64(providerDelay + handlerDelay + 30*time.Millisecond))))
		d.kill(t)
		var got httpAnswer
		select {
		case got = <-answer:
		case <-time.After(10 * time.Second):
			t.Fatalf("the killed demo's client did not return")
		}
		// A call the demo sent just before it died still reaches the
		// provider: let it arrive before telling the window.
		time.Sleep(50 * time.Millisecond)
		w := killBeforeCall
		switch {
		case len(db.orders(t, cart)) > 0 || got.Status != 0:
			w = killAfterCommit
		case stepDone(t, db, key):
			w = killAfterRecord
		case len(p.CallsFor(cart)) > 0:
			w = killWhileAnswer // the provider acted; nothing was recorded
		}
		windows[w]++
		p.SetDelay(0)
		d = startPayDemo(t, db, p, args()...)
		a := retryFinal(t, d, key, payOrder(cart), killRetryWithin)
		if a.code() == "payment_unknown" {
			unknowns[w]++
			if !refuse || w == killAfterRecord || w == killAfterCommit {
				t.Errorf("point %d (%s): unknown outcome %s", i, w, a.Body)
				continue
			}
			// The operator asks the provider: charged → --done, not → --forget.
			switch charges := p.ChargesFor(cart); len(charges) {
			case 0:
				settleStep(t, db, key, "--forget")
			case 1:
				settleStep(t, db, key, "--done", fmt.Sprintf(`{"id":%q}`, charges[0].ID))
			default:
				t.Errorf("point %d (%s): %d charges before the unknown outcome was settled", i, w, len(charges))
			}
			a = retryFinal(t, d, key, payOrder(cart), killRetryWithin)
		}
		charges, ords := p.ChargesFor(cart), db.orders(t, cart)
		if a.Status != 201 {
			t.Errorf("point %d (%s): final answer %d %s", i, w, a.Status, a.Body)
			continue
		}
		if len(charges) > 1 {
			doubles[w]++
			if mode == fakepay.HonoursKeys || refuse || w != killWhileAnswer {
				t.Errorf("point %d (%s): %d charges", i, w, len(charges))
			}
		}
		made, paid := map[string]bool{}, map[string]bool{}
		for _, c := range charges {
			made[c.ID] = true
		}
		for _, c := range ords {
			paid[c] = true
			if !made[c] {
				orphanOrders++
				t.Errorf("point %d (%s): an order carries charge %q, which the provider did not make (%+v)", i, w, c, charges)
			}
		}
		for _, c := range charges {
			if !paid[c.ID] && len(charges) == 1 {
				orphanCharges++
				t.Errorf("point %d (%s): no order carries charge %s", i, w, c.ID)
			}
		}
		if len(ords) != 1 {
			t.Errorf("point %d (%s): %d orders, want 1", i, w, len(ords))
		}
		if got := chargeIDOf(t, a); len(charges) == 0 || got != charges[len(charges)-1].ID {
			t.Errorf("point %d (%s): the final 201 carries %q, the provider made %+v", i, w, got, charges)
		}
		if (w == killAfterRecord || w == killAfterCommit) && len(p.CallsFor(cart)) > 1 {
			secondCalls++
			t.Errorf("point %d (%s): the provider saw %d calls after the charge was recorded", i, w, len(p.CallsFor(cart)))
		}
	}
	policy := "rerun"
	if refuse {
		policy = "refuse"
	}
	t.Logf("%s, provider %s keys, %s: %d kill points by window %v: double charges by window %v, unknown outcomes (settled with idem resolve) by window %v, %d orders without their charge, %d charges without an order (a double charge's first one aside), %d second calls after a recorded charge",
		db.name, map[fakepay.Mode]string{fakepay.HonoursKeys: "honouring", fakepay.IgnoresKeys: "ignoring"}[mode], policy, n, windows, doubles, unknowns, orphanOrders, orphanCharges, secondCalls)
}

// settleStep runs idem resolve --step charge settle… KEY until it is done:
// it leaves a key alone while a request holds it (the retry that met the
// unknown outcome does, for its --lease).
func settleStep(t *testing.T, db payDB, key string, settle ...string) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; {
		code, out, errOut := runIdem(t, db.dir, nil, append([]string{"resolve", "--db", db.db, "--scope", "t1", "--step", "charge"}, append(settle, key)...)...)
		if code == 0 {
			return
		}
		if !strings.Contains(out, "held by a request running now") || time.Now().After(deadline) {
			t.Fatalf("idem resolve --step charge %v: exit %d\n%s%s", settle, code, out, errOut)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestDemoPaymentRefuseUnanswered: with --payment-unknown refuse, a charge
// that was sent and got no answer in time (the provider charged, slowly) is
// an unknown outcome, not a transient failure: no retry charges again until
// the operator settles the step, whose derived key idem inspect shows.
func TestDemoPaymentRefuseUnanswered(t *testing.T) {
	t.Parallel()
	db := sqlitePayDB(t)
	p := fakepay.Start(fakepay.IgnoresKeys)
	t.Cleanup(p.Close)
	d := startPayDemo(t, db, p, "--payment-unknown", "refuse", "--payment-timeout", "300ms", "--lease", "1s")
	p.SetDelay(3 * time.Second)
	key, body := "unanswered-"+cliRandHex(4), payOrder("c_unanswered")
	a := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body)
	p.SetDelay(0)
	if a.Status != 502 || a.code() != "payment_unknown" {
		t.Fatalf("a charge unanswered within --payment-timeout: %d %s, want 502 payment_unknown", a.Status, a.Body)
	}
	for range 3 {
		if a = retryFinal(t, d, key, body, killRetryWithin); a.code() != "payment_unknown" {
			t.Fatalf("retry: %d %s, want payment_unknown", a.Status, a.Body)
		}
	}
	calls, charges := p.CallsFor("c_unanswered"), p.ChargesFor("c_unanswered")
	if len(calls) != 1 || len(charges) != 1 {
		t.Fatalf("%d calls and %d charges, want 1 and 1: a retry charged again", len(calls), len(charges))
	}
	_, out, _ := runIdem(t, db.dir, nil, "inspect", "--db", db.db, "--scope", "t1", key)
	if !strings.Contains(out, `step:        "charge" started`) || !strings.Contains(out, calls[0].Key) || !strings.Contains(out, "never recorded") {
		t.Fatalf("idem inspect does not show the unrecorded charge with derived key %s:\n%s", calls[0].Key, out)
	}
	settleStep(t, db, key, "--done", fmt.Sprintf(`{"id":%q}`, charges[0].ID))
	a = retryFinal(t, d, key, body, killRetryWithin)
	checkOneChargeOneOrder(t, db, p, "c_unanswered", a)
	if n := len(p.CallsFor("c_unanswered")); n != 1 {
		t.Fatalf("%d calls after the settled step, want 1", n)
	}
	_, out, _ = runIdem(t, db.dir, nil, "inspect", "--db", db.db, "--scope", "t1", key)
	if !strings.Contains(out, `step:        "charge" done`) || !strings.Contains(out, charges[0].ID) {
		t.Fatalf("idem inspect after the order:\n%s", out)
	}
}

// TestResolveStepUsage: idem resolve --step's usage errors and its "nothing
// to settle".
func TestResolveStepUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	dbArg := "sqlite:" + dir + "/keys.db"
	if code, out, errOut := runIdem(t, dir, nil, "migrate", "--db", dbArg); code != 0 {
		t.Fatalf("migrate: %d %s%s", code, out, errOut)
	}
	for _, c := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"--step", "charge", "k"}, 2, "exactly one of --done"},
		{[]string{"--done", "{}", "k"}, 2, "name it with --step"},
		{[]string{"--step", "charge", "--done", "{", "k"}, 2, "is not JSON"},
		{[]string{"--step", "charge", "--done", "{}", "--forget", "k"}, 2, "exactly one of --done"},
		{[]string{"--step", "charge", "--release", "--forget", "k"}, 2, "not --status"},
		{[]string{"--step", "charge", "--forget", "k"}, 1, `no step "charge"`},
	} {
		code, out, errOut := runIdem(t, dir, nil, append([]string{"resolve", "--db", dbArg, "--scope", "t1"}, c.args...)...)
		if code != c.code || !strings.Contains(out+errOut, c.want) {
			t.Errorf("idem resolve %v: exit %d, %q; want exit %d and %q", c.args, code, out+errOut, c.code, c.want)
		}
	}
}
