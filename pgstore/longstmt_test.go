package pgstore_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
)

// TestLongStatementPastHandlerTimeout: the handler's statement (pg_sleep(60))
// outlasts HandlerTimeout (1 s). PostgreSQL must cancel it at the deadline —
// the client hears back long before the 60 s — the handler's order must not
// commit, the client gets 503 idempotency_commit_failed, and the retry runs
// afresh. Both flows, over loopback HTTP.
func TestLongStatementPastHandlerTimeout(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 8)
			app := newOrderApp(t, db)
			var calls atomic.Int32
			hook := func(ctx context.Context) {
				if calls.Add(1) == 1 {
					_, _ = pgstore.Tx(ctx).Exec(ctx, `SELECT pg_sleep(60)`) // the handler ignores the error
				}
			}
			srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: f.flow, HandlerTimeout: time.Second}, app.handler("t", hook)))
			t.Cleanup(srv.Close)
			start := time.Now()
			a := post(srv.URL, "k", []byte(`{}`))
			if took := time.Since(start); took > 30*time.Second {
				t.Errorf("the answer took %v: the statement was not cancelled at HandlerTimeout", took)
			}
			if a.err != nil || a.status != http.StatusServiceUnavailable || problemCode(a.body) != idem.CodeCommitFailed {
				t.Errorf("first = %d %s %v, want 503 %s", a.status, a.body, a.err, idem.CodeCommitFailed)
			}
			if n := app.ordersFor(t, "k", ""); n != 0 {
				t.Errorf("%d orders after the timed-out attempt, want 0", n)
			}
			if b := post(srv.URL, "k", []byte(`{}`)); b.err != nil || b.status != http.StatusCreated || b.replayed {
				t.Errorf("retry = %d replayed=%v %s %v, want a fresh 201", b.status, b.replayed, b.body, b.err)
			}
			if n := app.ordersFor(t, "k", ""); n != 1 {
				t.Errorf("%d orders after the retry, want 1", n)
			}
		})
	}
}
