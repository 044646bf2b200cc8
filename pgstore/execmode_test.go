package pgstore_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/storetest"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// In every query execution mode of the pool (pgx picks parameter types from the
// server's description in some, from the Go values in others) a first-time
// request stores its record and its retry replays it, with headers, in both
// flows.
func TestQueryExecModes(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	base := newOrderApp(t, db)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheStatement, pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		for _, flow := range []idem.Flow{idem.FlowSingleTx, idem.FlowClaimComplete} {
			t.Run(mode.String()+"/"+flow.String(), func(t *testing.T) {
				cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
				if err != nil {
					t.Fatal(err)
				}
				cfg.MaxConns = 2
				cfg.ConnConfig.DefaultQueryExecMode = mode
				pool, err := pgxpool.NewWithConfig(ctx30(t), cfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(pool.Close)
				store, err := pgstore.New(pool, &pgstore.Config{Table: strings.ReplaceAll(base.store.Table(), `"`, "")})
				if err != nil {
					t.Fatal(err)
				}
				app := &orderApp{db: db, store: store, orders: base.orders}
				h := app.serve(t, &idem.Config{Flow: flow}, app.handler("mode", nil))
				key := "mode-" + randomHex(6)
				var first string
				for i, replay := range []bool{false, true} {
					req := httptest.NewRequest(http.MethodPost, "/orders", bytes.NewReader([]byte(`{"item":"book"}`)))
					req.Header.Set("Idempotency-Key", key)
					rec := httptest.NewRecorder()
					h.ServeHTTP(rec, req)
					if rec.Code != http.StatusCreated || (rec.Header().Get(idem.ReplayedHeader) == "true") != replay ||
						!strings.HasPrefix(rec.Header().Get("Location"), "/orders/") {
						t.Fatalf("request %d: status %d, replayed %q, Location %q: %s", i, rec.Code, rec.Header().Get(idem.ReplayedHeader), rec.Header().Get("Location"), rec.Body)
					}
					if i == 0 {
						first = rec.Body.String()
					} else if rec.Body.String() != first {
						t.Fatalf("replay %q, want %q", rec.Body, first)
					}
				}
				if n := app.ordersFor(t, key, "mode"); n != 1 {
					t.Fatalf("%d orders, want 1", n)
				}
			})
		}
	}
}

// The conformance suite (round trips of hostile headers, binary bodies and
// awkward keys, fencing, the linearizability check) in every query execution
// mode other than the default: in the simple protocol and in the modes that
// take parameter types from the Go values, pgx encodes the store's arguments
// differently from the extended protocol's described statements.
func TestConformanceQueryExecModes(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 2)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeCacheDescribe,
		pgx.QueryExecModeDescribeExec, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
			if err != nil {
				t.Fatal(err)
			}
			cfg.MaxConns = 8
			cfg.ConnConfig.DefaultQueryExecMode = mode
			pool, err := pgxpool.NewWithConfig(ctx30(t), cfg)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			storetest.Run(t, func(t *testing.T) idem.Store {
				s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("modes")})
				if err != nil {
					t.Fatal(err)
				}
				if err := s.Migrate(ctx30(t)); err != nil {
					t.Fatal(err)
				}
				return s
			})
		})
	}
}
