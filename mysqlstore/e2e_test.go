package mysqlstore_test

import (
	"bytes"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/racetest"
	"github.com/idemkit/idem/mysqlstore"
)

// ordersTable creates an orders table of its own, dropped at the end.
func ordersTable(t testing.TB, db *sql.DB) string {
	t.Helper()
	name := randomName("orders_")
	dropAtEnd(t, db, name)
	_, err := db.ExecContext(ctxFor(t), "CREATE TABLE `"+name+"` (id BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, item VARCHAR(100) NOT NULL) ENGINE=InnoDB")
	if err != nil {
		t.Fatal(err)
	}
	return name
}

func countOrders(t testing.TB, db *sql.DB, table, item string) int {
	t.Helper()
	var n int
	if err := db.QueryRowContext(ctxFor(t), "SELECT COUNT(*) FROM `"+table+"` WHERE item = ?", item).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// orderHandler inserts one order through the middleware's transaction and answers
// 201 with its ID. hold, when set, is called after the insert.
func orderHandler(table string, hold func(r *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := mysqlstore.Tx(r.Context())
		if tx == nil {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		var in struct{ Item string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		res, err := tx.ExecContext(r.Context(), "INSERT INTO `"+table+"` (item) VALUES (?)", in.Item)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		id, _ := res.LastInsertId()
		if hold != nil {
			hold(r)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"item":%q}`, id, in.Item)
	})
}

// connOrderHandler is orderHandler on mysqlstore.Conn, the documented handle.
func connOrderHandler(table string, hold func(r *http.Request)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := mysqlstore.Conn(r.Context())
		if q == nil {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		var in struct{ Item string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		res, err := q.ExecContext(r.Context(), "INSERT INTO `"+table+"` (item) VALUES (?)", in.Item)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		id, _ := res.LastInsertId()
		if hold != nil {
			hold(r)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d,"item":%q}`, id, in.Item)
	})
}

func newServer(t testing.TB, s *mysqlstore.Store, cfg *idem.Config, h http.Handler) *httptest.Server {
	t.Helper()
	mw, err := idem.New(s, cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	return srv
}

// 100 concurrent requests with one key, released from a barrier: exactly one order
// exists afterwards, and every answer is the 201, its byte-identical replay, or a 409.
// TestEndToEndRace runs testEndToEndRace with and without multiStatements (see bothModes).
func TestEndToEndRace(t *testing.T) { bothModes(t, testEndToEndRace) }

func testEndToEndRace(t *testing.T) {
	for _, flow := range []struct {
		name string
		flow idem.Flow
	}{{"ClaimComplete", idem.FlowClaimComplete}, {"SingleTx", idem.FlowSingleTx}} {
		t.Run(flow.name, func(t *testing.T) {
			t.Parallel()
			testEndToEndRaceFlow(t, flow.flow)
		})
	}
}

func testEndToEndRaceFlow(t *testing.T, flow idem.Flow) {
	db := openDB(t, 32, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	// Holding the transaction open a little widens the window in which requests
	// meet an in-flight record.
	srv := newServer(t, s, &idem.Config{Flow: flow}, orderHandler(orders, func(*http.Request) { time.Sleep(50 * time.Millisecond) }))

	before := mysqlstore.DeadlocksRetried()
	for round := range 3 {
		item := fmt.Sprintf("race-%d", round)
		key := randomName("key-")
		body := []byte(`{"item":"` + item + `"}`)
		results := racetest.Fire(100, racetest.Post(srv.URL+"/orders", key, body, nil))
		var executed []racetest.Result
		var replays []racetest.Result
		statuses := map[int]int{}
		for _, r := range results {
			if r.Err != nil {
				t.Fatalf("request failed: %v", r.Err)
			}
			statuses[r.Status]++
			switch {
			case r.Status == http.StatusCreated && r.Header.Get(idem.ReplayedHeader) == "true":
				replays = append(replays, r)
			case r.Status == http.StatusCreated:
				executed = append(executed, r)
			case r.Status == http.StatusConflict:
				if !strings.Contains(string(r.Body), idem.CodeKeyInUse) || r.Header.Get("Retry-After") == "" {
					t.Errorf("409 without code %s and Retry-After: %v %s", idem.CodeKeyInUse, r.Header, r.Body)
				}
			default:
				t.Errorf("unexpected answer %d: %s", r.Status, r.Body)
			}
		}
		t.Logf("round %d: statuses %v, %d replays", round, statuses, len(replays))
		if len(executed) != 1 {
			t.Fatalf("%d requests executed the handler, want exactly 1 (statuses %v)", len(executed), statuses)
		}
		// Afterwards, a retry replays it too.
		replays = append(replays, racetest.Fire(1, racetest.Post(srv.URL+"/orders", key, body, nil))...)
		for _, r := range replays {
			if r.Status != http.StatusCreated || !bytes.Equal(r.Body, executed[0].Body) || r.Header.Get("Location") != executed[0].Header.Get("Location") {
				t.Errorf("replay %d %q (Location %q) differs from the executed answer %q (Location %q)", r.Status, r.Body, r.Header.Get("Location"), executed[0].Body, executed[0].Header.Get("Location"))
			}
		}
		if n := countOrders(t, db, orders, item); n != 1 {
			t.Fatalf("%d orders stored for one key, want exactly 1", n)
		}
	}
	t.Logf("deadlocks retried during the race: %d", mysqlstore.DeadlocksRetried()-before)
}

// A handler whose lease is taken over while it runs cannot commit: its order is
// rolled back, and the taker's order commits once.
// TestFencing runs testFencing with and without multiStatements (see bothModes).
func TestFencing(t *testing.T) { bothModes(t, testFencing) }

func testFencing(t *testing.T) {
	for _, order := range []string{"taker commits first", "holder finishes first", "renewal notices"} {
		t.Run(order, func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 8, "")
			s := newStore(t, db)
			orders := ordersTable(t, db)
			inserted := make(chan struct{})
			proceed := make(chan struct{})
			var once sync.Once
			// In the first two cases a long lease keeps the middleware's renewal out
			// of the way: the fence under test is the completion's compare-and-set.
			// In the third, renewal finds the lease lost and cancels the handler.
			lease := time.Minute
			if order == "renewal notices" {
				lease = 300 * time.Millisecond
			}
			causes := make(chan error, 1)
			// Fencing is the claim-then-complete flow's (the single-transaction flow
			// has no lease to take over), so it is chosen explicitly.
			srv := newServer(t, s, &idem.Config{Lease: lease, Flow: idem.FlowClaimComplete}, orderHandler(orders, func(r *http.Request) {
				once.Do(func() { close(inserted) })
				select {
				case <-proceed:
				case <-r.Context().Done():
					causes <- context.Cause(r.Context())
				case <-time.After(30 * time.Second):
				}
			}))
			key := randomName("key-")
			body := []byte(`{"item":"holder"}`)

			type answer struct {
				status int
				body   string
				err    error
			}
			first := make(chan answer, 1)
			go func() {
				req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", bytes.NewReader(body))
				req.Header.Set("Idempotency-Key", key)
				resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
				if err != nil {
					first <- answer{err: err}
					return
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				first <- answer{status: resp.StatusCode, body: string(b)}
			}()
			select {
			case <-inserted:
			case a := <-first:
				t.Fatalf("the first request finished before its handler ran: %+v", a)
			case <-time.After(30 * time.Second):
				t.Fatal("the first request's handler did not run")
			}

			// Take the key over as a request arriving after the lease lapsed would.
			ctx := ctxFor(t)
			held, err := s.Get(ctx, "", key, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			later := held.LeaseUntil.Add(time.Second)
			if order == "renewal notices" {
				later = time.Now().Add(time.Hour) // past any renewed lease, within the TTL
			}
			taker := idem.ClaimRequest{
				Scope: "", Key: key, Fingerprint: held.Fingerprint, Token: "taker-" + key,
				Now: later, LeaseUntil: later.Add(time.Minute), ExpiresAt: later.Add(time.Hour),
			}
			if _, claimed, err := s.Claim(ctx, taker); err != nil || !claimed {
				t.Fatalf("takeover Claim = %v, %v; want claimed", claimed, err)
			}
			takerResp := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}}, Body: []byte(`{"item":"taker"}`)}
			takerDone := func() {
				tctx, tx, err := s.BeginTx(ctx)
				if err != nil {
					t.Fatal(err)
				}
				defer tx.Rollback(ctx)
				if _, err := mysqlstore.Tx(tctx).ExecContext(tctx, "INSERT INTO `"+orders+"` (item) VALUES ('taker')"); err != nil {
					t.Fatal(err)
				}
				if err := tx.Complete(ctx, "", key, taker.Token, takerResp, later, later.Add(time.Hour)); err != nil {
					t.Fatalf("the taker's Complete: %v", err)
				}
				if err := tx.Commit(ctx); err != nil {
					t.Fatal(err)
				}
			}

			var a answer
			switch order {
			case "taker commits first":
				takerDone()
				close(proceed)
				a = <-first
			case "holder finishes first":
				close(proceed)
				a = <-first
				takerDone()
			case "renewal notices":
				a = <-first
				var cause error
				select {
				case cause = <-causes:
				default:
				}
				if !errors.Is(cause, idem.ErrLockLost) {
					t.Errorf("the holder's context ended with %v, want ErrLockLost from the renewal", cause)
				}
				takerDone()
			}
			if a.err != nil {
				t.Fatal(a.err)
			}
			if a.status != http.StatusConflict || !strings.Contains(a.body, idem.CodeLeaseLost) {
				t.Errorf("the holder whose lease was taken over got %d %s, want 409 %s", a.status, a.body, idem.CodeLeaseLost)
			}
			if n := countOrders(t, db, orders, "holder"); n != 0 {
				t.Errorf("%d orders of the fenced-off holder committed, want 0", n)
			}
			if n := countOrders(t, db, orders, "taker"); n != 1 {
				t.Errorf("%d orders of the taker committed, want 1", n)
			}
			rec, err := s.Get(ctx, "", key, time.Now())
			if err != nil {
				t.Fatal(err)
			}
			if rec.State != idem.StateComplete || rec.Token != taker.Token || string(rec.Response.Body) != `{"item":"taker"}` {
				t.Errorf("record after the race = %+v, want the taker's complete record", rec)
			}
		})
	}
}

// The claim and the business write never leave half a result: when the handler's
// transaction cannot commit, nothing is stored and the key is free again.
// TestHandlerErrorRollsBack runs testHandlerErrorRollsBack with and without multiStatements (see bothModes).
func TestHandlerErrorRollsBack(t *testing.T) { bothModes(t, testHandlerErrorRollsBack) }

func testHandlerErrorRollsBack(t *testing.T) {
	db := openDB(t, 8, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	fail := true
	var mu sync.Mutex
	srv := newServer(t, s, &idem.Config{KeepFunc: func(status int) bool { return status < 500 }}, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		f := fail
		fail = false
		mu.Unlock()
		tx := mysqlstore.Tx(r.Context())
		if _, err := tx.ExecContext(r.Context(), "INSERT INTO `"+orders+"` (item) VALUES ('x')"); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if f {
			http.Error(w, "downstream failed", http.StatusBadGateway) // not kept: rolled back, key released
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	key := randomName("key-")
	post := func() int {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{}`))
		req.Header.Set("Idempotency-Key", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if got := post(); got != http.StatusBadGateway {
		t.Fatalf("first attempt = %d, want 502", got)
	}
	if n := countOrders(t, db, orders, "x"); n != 0 {
		t.Fatalf("%d orders after a rolled-back attempt, want 0", n)
	}
	if _, err := s.Get(ctxFor(t), "", key, time.Now()); !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("record after a rolled-back attempt: %v, want ErrNotFound", err)
	}
	if got := post(); got != http.StatusCreated {
		t.Fatalf("retry = %d, want 201", got)
	}
	if n := countOrders(t, db, orders, "x"); n != 1 {
		t.Fatalf("%d orders after the retry, want 1", n)
	}
}

// Every pooled connection held by a handler's transaction must not stall the
// completion: it runs on the transaction's own connection.
// TestCompleteWithPoolExhausted runs testCompleteWithPoolExhausted with and without multiStatements (see bothModes).
func TestCompleteWithPoolExhausted(t *testing.T) { bothModes(t, testCompleteWithPoolExhausted) }

func testCompleteWithPoolExhausted(t *testing.T) {
	const n = 2
	db := openDB(t, n, "")
	s := newStore(t, db)
	orders := ordersTable(t, db)
	var arrived sync.WaitGroup
	arrived.Add(n)
	all := make(chan struct{})
	go func() { arrived.Wait(); close(all) }()
	srv := newServer(t, s, &idem.Config{CleanupTimeout: 5 * time.Second}, orderHandler(orders, func(r *http.Request) {
		arrived.Done()
		select { // every connection is now held by a transaction
		case <-all:
		case <-time.After(20 * time.Second):
		}
	}))
	results := make(chan racetest.Result, n)
	for i := range n {
		go func() {
			results <- racetest.Fire(1, racetest.Post(srv.URL+"/orders", randomName("key-"), []byte(fmt.Sprintf(`{"item":"pool-%d"}`, i)), nil))[0]
		}()
	}
	for range n {
		r := <-results
		if r.Err != nil || r.Status != http.StatusCreated {
			t.Errorf("answer %d %s (%v), want 201", r.Status, r.Body, r.Err)
		}
	}
	select {
	case <-all:
	default:
		t.Error("the handlers never held all connections at once; the test proved nothing")
	}
}
