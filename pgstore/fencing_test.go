package pgstore_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestFencing: request A claims a key and inserts its order; while A's handler
// waits, request B (on a server whose clock runs an hour ahead, so A's lease has
// lapsed for it) takes the key over and commits its own order. When A finishes,
// its fenced completion fails and its order is rolled back: one order, B's.
// Leases and takeovers of a live holder belong to claim-then-complete (in the
// single-transaction flow, B gets 409 while A's transaction holds the lock).
func TestFencing(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 6)
	app := newOrderApp(t, db)
	key := "fence-" + randomHex(8)
	body := []byte(`{"item":"chair"}`)

	inserted := make(chan struct{})
	release := make(chan struct{})
	hookA := func(ctx context.Context) {
		close(inserted)
		select {
		case <-release:
		case <-ctx.Done(): // renewal found the lease lost
		}
	}
	var mu sync.Mutex
	events := map[string][]idem.EventKind{}
	observer := func(name string) idem.Observer {
		return idem.ObserverFunc(func(_ context.Context, e idem.Event) {
			mu.Lock()
			defer mu.Unlock()
			events[name] = append(events[name], e.Kind)
		})
	}
	srvA := httptest.NewServer(app.serve(t, &idem.Config{Flow: idem.FlowClaimComplete, Lease: 30 * time.Second, Observer: observer("A")}, app.handler("A", hookA)))
	defer srvA.Close()
	later := func() time.Time { return time.Now().Add(time.Hour) }
	srvB := httptest.NewServer(app.serve(t, &idem.Config{Flow: idem.FlowClaimComplete, Lease: 30 * time.Second, NowFunc: later, Observer: observer("B")}, app.handler("B", nil)))
	defer srvB.Close()

	answerA := make(chan answer, 1)
	go func() { answerA <- post(srvA.URL+"/orders", key, body) }()
	select {
	case <-inserted:
	case <-time.After(60 * time.Second):
		t.Fatal("handler A did not run within 60s")
	}

	b := post(srvB.URL+"/orders", key, body)
	if b.err != nil || b.status != http.StatusCreated || b.replayed || !bytes.Contains(b.body, []byte(`"B"`)) {
		t.Fatalf("B = %d replayed=%v %s (err %v); want B's own 201 after taking over A's lapsed lease", b.status, b.replayed, b.body, b.err)
	}
	if n := app.ordersFor(t, key, "B"); n != 1 {
		t.Fatalf("%d orders from B after it completed, want 1", n)
	}

	close(release)
	a := <-answerA
	if a.err != nil {
		t.Fatal(a.err)
	}
	if a.status != http.StatusConflict || problemCode(a.body) != idem.CodeLeaseLost {
		t.Errorf("A = %d %s; want 409 %s", a.status, a.body, idem.CodeLeaseLost)
	}
	if n := app.ordersFor(t, key, "A"); n != 0 {
		t.Errorf("A's order committed (%d rows) although its lease was taken over", n)
	}
	if n := app.ordersFor(t, key, ""); n != 1 {
		t.Errorf("%d orders for the key, want exactly 1 (B's)", n)
	}
	mu.Lock()
	if fmt.Sprint(events["B"]) != fmt.Sprint([]idem.EventKind{idem.EventTakenOver, idem.EventExecuted}) {
		t.Errorf("server B saw events %v, want [taken_over executed]", events["B"])
	}
	if slices.Contains(events["A"], idem.EventTakenOver) {
		t.Errorf("server A reported its fresh claim as a takeover: %v", events["A"])
	}
	mu.Unlock()
	// Every retry now gets B's answer.
	r := post(srvA.URL+"/orders", key, body)
	if r.err != nil || r.status != http.StatusCreated || !r.replayed || !bytes.Equal(r.body, b.body) {
		t.Errorf("retry = %d replayed=%v %s (err %v); want a replay of B's %s", r.status, r.replayed, r.body, r.err, b.body)
	}
}
