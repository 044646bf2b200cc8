package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestLapseAtCompletion: request A holds a key (claim-then-complete, its order
// inserted in its transaction) and its lease lapses, by the shared clock, at
// the very moment its handler returns; from one barrier, A's completion and
// eight duplicates on a second server (whose claims take the lapsed lease over)
// race. Exactly one of the two executions commits, atomically with its stored
// answer: A's 201 (and every duplicate replays it or heard 409 while it ran), or
// the takeover's order (and A hears 409 idempotency_lease_lost, its order rolled
// back) — never both, never neither. Half the rounds release A only after a
// duplicate has answered, so the takeover side is always exercised too.
func TestLapseAtCompletion(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 16)
	app := newOrderApp(t, db)
	const lease = 2 * time.Minute // no renewal falls due on the wall clock during a round
	var offset atomic.Int64
	t0 := time.Now()
	clock := func() time.Time { return t0.Add(time.Duration(offset.Load())) }
	cfg := &idem.Config{Flow: idem.FlowClaimComplete, Lease: lease, NowFunc: clock}

	var hookMu sync.Mutex
	hooks := map[string]chan struct{}{}
	inserted := make(chan string, 1)
	hookA := func(ctx context.Context) {
		_, key, _ := idem.KeyFrom(ctx)
		hookMu.Lock()
		gate := hooks[key]
		hookMu.Unlock()
		inserted <- key
		<-gate
	}
	srvA := httptest.NewServer(app.serve(t, cfg, app.handler("A", hookA)))
	defer srvA.Close()
	srvB := httptest.NewServer(app.serve(t, cfg, app.handler("B", nil)))
	defer srvB.Close()

	var tookOver, aWon int
	for round := range 12 {
		key := fmt.Sprintf("lapse-%d-%s", round, randomHex(4))
		body := []byte(`{"item":"chair"}`)
		gate := make(chan struct{})
		hookMu.Lock()
		hooks[key] = gate
		hookMu.Unlock()
		offset.Store(0)
		answerA := make(chan answer, 1)
		go func() { answerA <- post(srvA.URL+"/orders", key, body) }()
		select {
		case <-inserted:
		case <-time.After(60 * time.Second):
			t.Fatal("handler A did not run within 60s")
		}
		offset.Store(int64(lease)) // LeaseUntil == now: lapsed

		releaseLate := round%2 == 1
		const n = 8
		answers := make([]answer, n)
		start := make(chan struct{})
		firstDone := make(chan struct{})
		var once sync.Once
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				answers[i] = post(srvB.URL+"/orders", key, body)
				once.Do(func() { close(firstDone) })
			})
		}
		wg.Go(func() {
			<-start
			if releaseLate {
				<-firstDone
			}
			close(gate)
		})
		close(start)
		wg.Wait()
		a := <-answerA

		ordersA, ordersB := app.ordersFor(t, key, "A"), app.ordersFor(t, key, "B")
		if ordersA+ordersB != 1 {
			t.Fatalf("round %d: %d orders from A and %d from B committed, want exactly one (A = %d %s)", round, ordersA, ordersB, a.status, a.body)
		}
		winner := `"tag":"A"`
		if ordersB == 1 {
			winner = `"tag":"B"`
			tookOver++
			if a.status != http.StatusConflict || problemCode(a.body) != idem.CodeLeaseLost {
				t.Errorf("round %d: taken over, but A = %d %s; want 409 %s", round, a.status, a.body, idem.CodeLeaseLost)
			}
		} else {
			aWon++
			if a.status != http.StatusCreated || a.replayed || !bytes.Contains(a.body, []byte(winner)) {
				t.Errorf("round %d: A's order committed, but A = %d %s", round, a.status, a.body)
			}
		}
		fresh := 0
		for i, b := range answers {
			switch {
			case b.err != nil:
				t.Fatalf("round %d duplicate %d: %v", round, i, b.err)
			case b.status == http.StatusConflict && problemCode(b.body) == idem.CodeKeyInUse:
			case b.status == http.StatusCreated && bytes.Contains(b.body, []byte(winner)):
				if !b.replayed {
					fresh++
				}
			default:
				t.Errorf("round %d duplicate %d: %d replayed=%v %s (the committed order is %s)", round, i, b.status, b.replayed, b.body, winner)
			}
		}
		if want := ordersB; fresh != want {
			t.Errorf("round %d: %d duplicates answered with a fresh execution, want %d", round, fresh, want)
		}
		if releaseLate && ordersB != 1 {
			t.Errorf("round %d: A was released after a duplicate answered, yet the lapsed lease was not taken over", round)
		}
		r := post(srvA.URL+"/orders", key, body)
		if r.err != nil || !r.replayed || !bytes.Contains(r.body, []byte(winner)) {
			t.Fatalf("round %d: the replay = %d %s (err %v), want the committed %s", round, r.status, r.body, r.err, winner)
		}
	}
	t.Logf("taken over %d times, A completed first %d times", tookOver, aWon)
}
