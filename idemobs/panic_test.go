package idemobs_test

import (
	"context"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/memstore"
)

// panicOnce is a StoreObserver (an exporter with a bug) whose StoreDone panics
// the first time it is told about op.
type panicOnce struct {
	op    idemobs.Op
	fired atomic.Bool
}

func (p *panicOnce) StoreStart(ctx context.Context, _ idemobs.Op) context.Context { return ctx }

func (p *panicOnce) StoreDone(_ context.Context, op idemobs.Op, _ time.Duration, _ error) {
	if op == p.op && p.fired.CompareAndSwap(false, true) {
		panic("exporter bug")
	}
}

// TestObserverPanicAfterClaimLeavesKeyFree: a StoreObserver that panics in
// StoreDone after a Claim that succeeded must not leave the key held: the
// middleware never learnt of the claim, so nothing would release it, and every
// retry would hear 409 until the lease lapsed (under LapsedRefuse, until an
// operator resolved it). The panic goes on; the retry runs the handler.
func TestObserverPanicAfterClaimLeavesKeyFree(t *testing.T) {
	t.Parallel()
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	var runs atomic.Int64
	mw, err := idem.New(idemobs.Store(mem, &panicOnce{op: idemobs.OpClaim}), &idem.Config{Lease: time.Hour, LapsedLease: idem.LapsedRefuse})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { runs.Add(1); w.WriteHeader(201) })))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0)
	srv.Start()
	t.Cleanup(srv.Close)
	post := func() (int, error) {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k-obs-panic")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, err
		}
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	if code, err := post(); err == nil {
		t.Fatalf("first request: %d; want the connection dropped by the observer's panic", code)
	}
	if code, err := post(); err != nil || code != 201 || runs.Load() != 1 {
		t.Fatalf("retry after the observer panicked: %d, %v, %d executions; want 201 from a fresh execution", code, err, runs.Load())
	}
}
