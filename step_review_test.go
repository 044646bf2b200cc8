package idem_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
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
