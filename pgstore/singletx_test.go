package pgstore_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestSingleTxConcurrentReplays: many BeginLocked calls on one complete key at
// the same moment all get the record, none ErrInFlight, although each of them
// tries the key's lock and only one at a time can hold it.
func TestSingleTxConcurrentReplays(t *testing.T) {
	t.Parallel()
	const n = 30
	db := newTestDB(t, n+2)
	s := db.newStore(t)
	now := time.Now()
	_, tx, _, err := s.BeginLocked(ctx30(t), "s", "k", now)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Insert(ctx30(t), &idem.Record{Scope: "s", Key: "k", State: idem.StateComplete, Fingerprint: "v1:a", Token: "t",
		CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 201, Body: []byte("one")}}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	for round := range 5 {
		var wg sync.WaitGroup
		start := make(chan struct{})
		errs := make(chan error, n)
		for range n {
			wg.Go(func() {
				<-start
				_, tx, rec, err := s.BeginLocked(ctx30(t), "s", "k", now.Add(time.Second))
				if err != nil {
					errs <- err
					return
				}
				time.Sleep(2 * time.Millisecond) // hold the lock (if granted) while others look
				_ = tx.Rollback(context.Background())
				if rec == nil || rec.State != idem.StateComplete || string(rec.Response.Body) != "one" {
					errs <- fmt.Errorf("record %+v, want the complete record", rec)
				}
			})
		}
		close(start)
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Errorf("round %d: BeginLocked of a complete key: %v", round, err)
		}
	}
}

// TestSingleTxRacesClaimComplete sends many requests with one fresh key at the
// same moment, half through the single-transaction flow and half through
// claim-then-complete, on one table: exactly one executes (a single-transaction
// request whose record insert meets a claim rolls back and answers 409), and
// every other answer is a 409 or a replay of it.
func TestSingleTxRacesClaimComplete(t *testing.T) {
	t.Parallel()
	const n = 40
	db := newTestDB(t, n+4)
	app := newOrderApp(t, db)
	slow := func(context.Context) { time.Sleep(20 * time.Millisecond) }
	single := httptest.NewServer(app.serve(t, &idem.Config{Flow: idem.FlowSingleTx}, app.handler("single", slow)))
	defer single.Close()
	claim := httptest.NewServer(app.serve(t, &idem.Config{Flow: idem.FlowClaimComplete}, app.handler("claim", slow)))
	defer claim.Close()
	body := []byte(`{"item":"book"}`)
	for round := range 4 {
		key := fmt.Sprintf("mixed-%d-%s", round, randomHex(4))
		answers := make([]answer, n)
		var wg sync.WaitGroup
		start := make(chan struct{})
		for i := range n {
			url := single.URL
			if i%2 == 1 {
				url = claim.URL
			}
			wg.Go(func() {
				<-start
				answers[i] = post(url+"/orders", key, body)
			})
		}
		close(start)
		wg.Wait()
		executed := 0
		var first []byte
		for i, a := range answers {
			switch {
			case a.err != nil:
				t.Fatalf("request %d: %v", i, a.err)
			case a.status == http.StatusCreated && !a.replayed:
				executed++
				first = a.body
			case a.status == http.StatusCreated && a.replayed:
			case a.status == http.StatusConflict && problemCode(a.body) == idem.CodeKeyInUse:
			default:
				t.Errorf("request %d: %d %s", i, a.status, a.body)
			}
		}
		if executed != 1 {
			t.Fatalf("round %d: %d requests executed, want 1", round, executed)
		}
		for i, a := range answers {
			if a.replayed && !bytes.Equal(a.body, first) {
				t.Errorf("request %d replayed %s, want %s", i, a.body, first)
			}
		}
		if got := app.ordersFor(t, key, ""); got != 1 {
			t.Fatalf("round %d: %d orders, want 1", round, got)
		}
	}
}

// TestSingleTxReplacesExpired: a record that was expired when BeginLocked read
// it is replaced at commit, also when the janitor deleted it meanwhile; a claim
// that replaced it meanwhile wins, and the commit reports ErrInFlight.
func TestSingleTxReplacesExpired(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	past := time.Now().Add(-2 * time.Hour)
	now := time.Now()
	expire := func(key string) {
		t.Helper()
		if _, claimed, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: key, Fingerprint: "v1:old", Token: "old", Now: past, LeaseUntil: past.Add(time.Minute), ExpiresAt: past.Add(time.Hour)}); err != nil || !claimed {
			t.Fatalf("Claim: %v %v", claimed, err)
		}
	}
	rec := func(key string) *idem.Record {
		return &idem.Record{Scope: "s", Key: key, State: idem.StateComplete, Fingerprint: "v1:new", Token: "new",
			CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 201, Body: []byte("new")}}
	}

	for _, janitor := range []bool{false, true} {
		key := fmt.Sprintf("expired-%v", janitor)
		expire(key)
		_, tx, got, err := s.BeginLocked(ctx30(t), "s", key, now)
		if err != nil || got != nil {
			t.Fatalf("BeginLocked over an expired record = %+v, %v; want no record", got, err)
		}
		if janitor {
			if n, err := s.DeleteExpired(ctx30(t), now, 100); err != nil || n != 1 {
				t.Fatalf("DeleteExpired = %d, %v; want 1", n, err)
			}
		}
		if err := tx.Insert(ctx30(t), rec(key)); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx30(t)); err != nil {
			t.Fatalf("janitor %v: Commit = %v", janitor, err)
		}
		if r, err := s.Get(ctx30(t), "s", key, now); err != nil || r.Token != "new" || string(r.Response.Body) != "new" {
			t.Fatalf("janitor %v: record after commit = %+v, %v", janitor, r, err)
		}
	}

	expire("reclaimed")
	_, tx, _, err := s.BeginLocked(ctx30(t), "s", "reclaimed", now)
	if err != nil {
		t.Fatal(err)
	}
	if _, claimed, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: "s", Key: "reclaimed", Fingerprint: "v1:c", Token: "c", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("Claim over the expired record: %v %v", claimed, err)
	}
	if err := tx.Insert(ctx30(t), rec("reclaimed")); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx30(t)); !errors.Is(err, idem.ErrInFlight) {
		t.Fatalf("Commit over a claim that replaced the expired record = %v, want ErrInFlight", err)
	}
	if r, err := s.Get(ctx30(t), "s", "reclaimed", now); err != nil || r.Token != "c" || r.State != idem.StateInFlight {
		t.Fatalf("the claim was changed: %+v, %v", r, err)
	}
}
