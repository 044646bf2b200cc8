package mysqlstore_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestClaimWaitingOnALockOutlivesTheClient: a claim waits on a row lock (the
// key's expired record is locked by another transaction) when its client hangs
// up. go-sql-driver would close the connection of a canceled statement, but
// MariaDB commits the claim once the lock is granted, leaving the key in flight
// under a token nobody holds: retries heard 409 for a lease and then, under
// LapsedRefuse, an unknown outcome for an operation that never ran. The claim
// is not abandoned: it ends, the operation runs once, and the retry replays.
func TestClaimWaitingOnALockOutlivesTheClient(t *testing.T) { bothModes(t, testClaimWaitingOnALock) }

func testClaimWaitingOnALock(t *testing.T) {
	db := openDB(t, 6, "")
	s := newStore(t, db)
	key := randomName("hang-")
	past := time.Now().Add(-2 * time.Hour)
	// An expired record, so that the claim takes the INSERT … ON DUPLICATE KEY
	// UPDATE path and waits on the row.
	old := claimReq("", key, "v3:old", past)
	old.ExpiresAt = past.Add(time.Minute)
	if _, ok, err := s.Claim(ctxFor(t), old); err != nil || !ok {
		t.Fatalf("plant an expired record: %v %v", ok, err)
	}
	locker, err := db.BeginTx(ctxFor(t), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback() }()
	var one int
	if err := locker.QueryRowContext(ctxFor(t), "SELECT 1 FROM `"+s.Table()+"` WHERE `scope` = '' AND `key` = ? FOR UPDATE", key).Scan(&one); err != nil {
		t.Fatal(err)
	}
	var runs atomic.Int64
	executed := make(chan struct{})
	mw, err := idem.New(s, &idem.Config{Flow: idem.FlowClaimComplete, LapsedLease: idem.LapsedRefuse,
		Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
			if e.Kind == idem.EventExecuted {
				close(executed)
			}
		})})
	if err != nil {
		t.Fatal(err)
	}
	hungUp := make(chan struct{})
	var arrived atomic.Int64
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if arrived.Add(1) == 1 {
			go func() { <-r.Context().Done(); close(hungUp) }()
		}
		h.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL+"/orders", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", key)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	// Wait until the claim waits on the row lock, then hang up.
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		var waiting int
		if err := db.QueryRowContext(ctxFor(t), "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE ?", "INSERT INTO `"+s.Table()+"`%").Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting > 0 {
			break
		}
		if time.Now().After(deadline) {
			rows, _ := db.QueryContext(ctxFor(t), "SELECT trx_state, COALESCE(trx_query, '') FROM information_schema.INNODB_TRX")
			for rows != nil && rows.Next() {
				var st, q string
				_ = rows.Scan(&st, &q)
				t.Logf("trx %s %.200s", st, q)
			}
			t.Fatalf("the claim never waited on the row lock (%d requests arrived)", arrived.Load())
		}
	}
	cancel()
	<-done
	<-hungUp
	if err := locker.Rollback(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-executed:
	case <-time.After(30 * time.Second):
		t.Fatal("the claimed operation never ran: the claim was abandoned with its client")
	}
	a, body, replayed := postKey(t, srv.URL, key)
	if a != http.StatusCreated || !replayed {
		t.Fatalf("retry: %d %s (replayed %v), want the 201 replayed", a, body, replayed)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
}
