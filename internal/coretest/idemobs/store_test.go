package idemobs_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// opLog records the operations a decorated store reports.
type opLog struct {
	mu     sync.Mutex
	starts map[idemobs.Op]int
	dones  map[idemobs.Op]int
	fails  map[idemobs.Op]int
}

func newOpLog() *opLog {
	return &opLog{starts: map[idemobs.Op]int{}, dones: map[idemobs.Op]int{}, fails: map[idemobs.Op]int{}}
}

func (l *opLog) StoreStart(ctx context.Context, op idemobs.Op) context.Context {
	l.mu.Lock()
	l.starts[op]++
	l.mu.Unlock()
	return ctx
}

func (l *opLog) StoreDone(_ context.Context, op idemobs.Op, took time.Duration, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.dones[op]++
	if idemobs.Failed(err) {
		l.fails[op]++
	}
}

type (
	txOnly     struct{ idem.TxStore }
	singleOnly struct{ idem.SingleTxStore }
	txSingle   struct{ *sqlitestore.Store }
	plainStore struct{ idem.Store }
)

type prefers struct{ f idem.Flow }

func (p prefers) PreferredFlow() idem.Flow { return p.f }

type (
	txPref struct {
		idem.TxStore
		prefers
	}
	singlePref struct {
		idem.SingleTxStore
		prefers
	}
	txSinglePref struct {
		*sqlitestore.Store
		prefers
	}
	plainPref struct {
		idem.Store
		prefers
	}
)

// TestStoreForwardsExactlyTheOptionalInterfaces decorates stores with every
// combination of TxStore, SingleTxStore and FlowPreferrer, and checks that the
// decorated store implements exactly the same ones, with the same preference.
func TestStoreForwardsExactlyTheOptionalInterfaces(t *testing.T) {
	t.Parallel()
	sq, _ := openSQLite(t, "forward")
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	single := prefers{idem.FlowSingleTx}
	for _, s := range []idem.Store{
		plainStore{mem}, txOnly{sq}, singleOnly{sq}, txSingle{sq}, sq,
		plainPref{mem, single}, txPref{sq, single}, singlePref{sq, single}, txSinglePref{sq, single},
	} {
		d := idemobs.Store(s, newOpLog())
		_, tx := s.(idem.TxStore)
		_, dtx := d.(idem.TxStore)
		_, sg := s.(idem.SingleTxStore)
		_, dsg := d.(idem.SingleTxStore)
		p, pf := s.(idem.FlowPreferrer)
		dp, dpf := d.(idem.FlowPreferrer)
		if tx != dtx || sg != dsg || pf != dpf {
			t.Errorf("%T: TxStore %v→%v, SingleTxStore %v→%v, FlowPreferrer %v→%v; want the same", s, tx, dtx, sg, dsg, pf, dpf)
		}
		if pf && dpf && p.PreferredFlow() != dp.PreferredFlow() {
			t.Errorf("%T: PreferredFlow %v, decorated %v", s, p.PreferredFlow(), dp.PreferredFlow())
		}
		if u, ok := d.(idemobs.Unwrapper); !ok || u.Unwrap() != s {
			t.Errorf("%T: Unwrap does not return the store", s)
		}
	}
}

func openSQLite(t *testing.T, table string) (*sqlitestore.Store, *sql.DB) {
	t.Helper()
	db, err := embedded.Open(filepath.Join(t.TempDir(), table+".db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlitestore.New(db, &sqlitestore.Config{Table: table + "_records"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec(`CREATE TABLE orders (id INTEGER PRIMARY KEY, cart TEXT NOT NULL UNIQUE)`); err != nil {
		t.Fatal(err)
	}
	return s, db
}

// TestStoreKeepsTransactionalCompletion runs the middleware over a decorated
// sqlitestore in both flows: the handler's write happens in the middleware's
// transaction (sqlitestore.Tx finds it), commits with the stored answer when
// the outcome is kept, and rolls back with it when it is not; every operation
// is reported.
func TestStoreKeepsTransactionalCompletion(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			s, db := openSQLite(t, "txc")
			log := newOpLog()
			mw, err := idem.New(idemobs.Store(s, log), &idem.Config{Flow: flow, KeepFunc: func(st int) bool { return st < 500 }})
			if err != nil {
				t.Fatal(err)
			}
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tx := sqlitestore.Tx(r.Context())
				if tx == nil {
					http.Error(w, "no transaction in the handler's context", http.StatusTeapot)
					return
				}
				cart := strings.TrimPrefix(r.URL.Path, "/")
				if _, err := tx.ExecContext(r.Context(), `INSERT INTO orders (cart) VALUES (?)`, cart); err != nil {
					http.Error(w, err.Error(), http.StatusConflict)
					return
				}
				if strings.HasPrefix(cart, "fail") {
					w.WriteHeader(http.StatusInternalServerError) // not kept: rolled back
					return
				}
				w.WriteHeader(http.StatusCreated)
			})))
			t.Cleanup(srv.Close)
			post := func(path, key string) (int, string) {
				req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader("{}"))
				req.Header.Set("Idempotency-Key", key)
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				defer resp.Body.Close()
				return resp.StatusCode, resp.Header.Get(idem.ReplayedHeader)
			}
			if st, _ := post("/ok", "k1"); st != 201 {
				t.Fatalf("first POST: %d, want 201", st)
			}
			if st, rep := post("/ok", "k1"); st != 201 || rep != "true" {
				t.Fatalf("retry: %d replayed %q, want the stored 201", st, rep)
			}
			if st, _ := post("/fail", "k2"); st != 500 {
				t.Fatalf("failing POST: %d, want 500", st)
			}
			var carts []string
			rows, err := db.Query(`SELECT cart FROM orders ORDER BY cart`)
			if err != nil {
				t.Fatal(err)
			}
			for rows.Next() {
				var c string
				_ = rows.Scan(&c)
				carts = append(carts, c)
			}
			rows.Close()
			if fmt.Sprint(carts) != "[ok]" {
				t.Errorf("orders = %v; want [ok]: the kept one committed with its record, the released one rolled back", carts)
			}
			if _, err := s.Get(context.Background(), "", "k2", time.Now()); !errors.Is(err, idem.ErrNotFound) {
				t.Errorf("the released key has a record: %v", err)
			}
			log.mu.Lock()
			defer log.mu.Unlock()
			want := map[idemobs.Op]int{idemobs.OpBegin: 2, idemobs.OpCommit: 1}
			if flow == idem.FlowSingleTx {
				want[idemobs.OpBegin] = 3 // the replay reads the record under the lock too
				want[idemobs.OpInsert] = 1
			} else {
				want[idemobs.OpClaim] = 3
				want[idemobs.OpComplete] = 1
				want[idemobs.OpRelease] = 1
			}
			for op, n := range want {
				if log.starts[op] != n || log.dones[op] != n {
					t.Errorf("%s: %d started, %d done; want %d (all: %v)", op, log.starts[op], log.dones[op], n, log.dones)
				}
			}
			if len(log.fails) != 0 {
				t.Errorf("failures reported: %v", log.fails)
			}
		})
	}
}

// A decorated store says it copies responses (idem.ResponseCopier) exactly
// when the store it decorates does — the decorators pass the response through
// and keep nothing — so that the middleware's pooling of stored responses
// survives idemobs, idemotel and idemprom.
func TestStoreForwardsResponseCopier(t *testing.T) {
	t.Parallel()
	sq, _ := openSQLite(t, "copier")
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	single := prefers{idem.FlowSingleTx}
	for _, s := range []idem.Store{
		mem, sq, plainStore{mem}, txOnly{sq}, singleOnly{sq}, txSingle{sq},
		plainPref{mem, single}, txPref{sq, single}, singlePref{sq, single}, txSinglePref{sq, single},
	} {
		want := false
		if c, ok := s.(idem.ResponseCopier); ok {
			want = c.CopiesResponses()
		}
		got := false
		if c, ok := idemobs.Store(s, newOpLog()).(idem.ResponseCopier); ok {
			got = c.CopiesResponses()
		}
		if got != want {
			t.Errorf("%T: copies responses %v, decorated %v; want the same", s, want, got)
		}
	}
}
