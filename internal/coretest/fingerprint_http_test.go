package idem_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// newPGStore opens a migrated pgstore in a table of the test's own, or skips
// when PostgreSQL is not reachable (unless IDEM_REQUIRE_SERVICES=1).
func newPGStore(t *testing.T) *pgstore.Store {
	t.Helper()
	return newPGStoreConns(t, 0)
}

// newPGStoreConns is newPGStore with a pool of maxConns connections (0:
// pgxpool's default).
func newPGStoreConns(t *testing.T, maxConns int32) *pgstore.Store {
	t.Helper()
	raw := testenv.PostgresURL(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pcfg, err := pgxpool.ParseConfig(raw)
	if err != nil {
		t.Fatal(err)
	}
	if maxConns > 0 {
		pcfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	var b [6]byte
	_, _ = rand.Read(b[:])
	table := "idem_fp_" + hex.EncodeToString(b[:])
	s, err := pgstore.New(pool, &pgstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+table+", "+s.StepsTable()) })
	return s
}

// fpStores runs check on SQLite (both flows) and PostgreSQL (both flows).
func fpStores(t *testing.T, check func(t *testing.T, s idem.Store, flow idem.Flow)) {
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run("sqlite-"+flow.String(), func(t *testing.T) {
			t.Parallel()
			check(t, newSQLiteStore(t), flow)
		})
		t.Run("postgres-"+flow.String(), func(t *testing.T) {
			t.Parallel()
			check(t, newPGStore(t), flow)
		})
	}
}

// send posts body to url with key and returns the status, the idem error code
// (if any) and the body.
func send(t *testing.T, url, key, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// The default fingerprint covers the raw query string as sent, over real
// stores and sockets: parameters in another order, or encoded where they were
// raw, are another request (422, the handler does not run again); an empty
// query ("/pay?") is the same as none; a retry with the same query replays.
func TestQueryFormsOverStores(t *testing.T) {
	fpStores(t, func(t *testing.T, s idem.Store, flow idem.Flow) {
		var runs atomic.Int64
		mw, err := idem.New(s, &idem.Config{Flow: flow})
		if err != nil {
			t.Fatal(err)
		}
		srv := serveLoopback(t, mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			n := runs.Add(1)
			w.WriteHeader(http.StatusCreated)
			fmt.Fprintf(w, "run %d query %q", n, r.URL.RawQuery)
		})))
		for _, c := range []struct {
			first, then string
			same        bool
		}{
			{"/pay?a=1&b=2", "/pay?b=2&a=1", false},
			{"/pay?a=1", "/pay?a=%31", false},
			{"/pay?a=1", "/pay?a=1000", false},
			{"/pay?a=1", "/pay", false},
			{"/pay?a=b+c", "/pay?a=b%20c", false},
			{"/pay?", "/pay", true},
			{"/pay", "/pay?", true},
			{"/pay?a=1&b=2", "/pay?a=1&b=2", true},
		} {
			key := "k-" + hex.EncodeToString([]byte(c.first+"|"+c.then))
			st, first := send(t, srv.URL+c.first, key, "{}")
			if st != http.StatusCreated {
				t.Fatalf("%s: %d %s", c.first, st, first)
			}
			before := runs.Load()
			st, then := send(t, srv.URL+c.then, key, "{}")
			switch {
			case c.same && (st != http.StatusCreated || then != first):
				t.Errorf("%s then %s: %d %q, want the replay %q", c.first, c.then, st, then, first)
			case !c.same && (st != http.StatusUnprocessableEntity || !strings.Contains(then, idem.CodeKeyReused)):
				t.Errorf("%s then %s: %d %q, want 422 %s", c.first, c.then, st, then, idem.CodeKeyReused)
			}
			if runs.Load() != before {
				t.Errorf("%s then %s: the handler ran again", c.first, c.then)
			}
		}
	})
}

// A custom FingerprintFunc with a version of its own on one route, the default
// on another, one store and one scope: the same key sent to the other route is
// a 422 whichever route stored it first, and neither handler runs twice.
func TestCustomFingerprintOtherRouteOverStores(t *testing.T) {
	fpStores(t, func(t *testing.T, s idem.Store, flow idem.Flow) {
		var runs atomic.Int64
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			w.WriteHeader(http.StatusCreated)
		})
		def, err := idem.New(s, &idem.Config{Flow: flow})
		if err != nil {
			t.Fatal(err)
		}
		custom, err := idem.New(s, &idem.Config{Flow: flow, FingerprintFunc: func(r *http.Request, body []byte) string {
			return "acme1:" + r.Method + " " + r.URL.Path
		}})
		if err != nil {
			t.Fatal(err)
		}
		mux := http.NewServeMux()
		mux.Handle("/a", def(h))
		mux.Handle("/b", custom(h))
		srv := serveLoopback(t, mux)
		for _, order := range [][2]string{{"/a", "/b"}, {"/b", "/a"}} {
			key := "k" + strings.ReplaceAll(order[0]+order[1], "/", "-")
			if st, b := send(t, srv.URL+order[0], key, "{}"); st != http.StatusCreated {
				t.Fatalf("%s: %d %s", order[0], st, b)
			}
			before := runs.Load()
			if st, b := send(t, srv.URL+order[1], key, "{}"); st != http.StatusUnprocessableEntity || !strings.Contains(b, idem.CodeKeyReused) {
				t.Errorf("%s then %s: %d %s, want 422 %s", order[0], order[1], st, b, idem.CodeKeyReused)
			}
			if runs.Load() != before {
				t.Errorf("%s then %s: the handler ran again", order[0], order[1])
			}
		}
	})
}
