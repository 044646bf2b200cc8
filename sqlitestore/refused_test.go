package sqlitestore_test

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
)

type exchange struct {
	status   int
	code     string
	retry    string
	replayed bool
}

func send(t *testing.T, url, key, body string) exchange {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var p idem.Problem
	_ = json.Unmarshal(b, &p)
	return exchange{resp.StatusCode, p.Code, resp.Header.Get("Retry-After"), resp.Header.Get(idem.ReplayedHeader) == "true"}
}

// TestRefusedCommitIsAborted: a deferred foreign key naming a missing row
// makes SQLite refuse the COMMIT. Nothing committed, and SQLite is in the
// process, so that is idem.ErrTxAborted — not a commit of unknown outcome (503
// idempotency_commit_failed with Retry-After, which every retry met again). A
// 201 becomes a non-retryable 500; a 409 the handler answered is kept. Both
// flows.
func TestRefusedCommitIsAborted(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db := openDB(t)
			s := newStore(t, db)
			suffix := randomHex(4)
			for _, ddl := range []string{
				"CREATE TABLE parents_" + suffix + " (id INTEGER PRIMARY KEY)",
				"CREATE TABLE children_" + suffix + " (id INTEGER PRIMARY KEY, parent INTEGER NOT NULL REFERENCES parents_" + suffix + "(id) DEFERRABLE INITIALLY DEFERRED)",
			} {
				if _, err := db.Exec(ddl); err != nil {
					t.Fatal(err)
				}
			}
			mw, err := idem.New(s, &idem.Config{Flow: flow})
			if err != nil {
				t.Fatal(err)
			}
			var runs atomic.Int64
			srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				runs.Add(1)
				if _, err := sqlitestore.Tx(r.Context()).ExecContext(r.Context(), "INSERT INTO children_"+suffix+" (parent) VALUES (42)"); err != nil {
					http.Error(w, err.Error(), 500)
					return
				}
				status, _ := strconv.Atoi(r.URL.Query().Get("status"))
				w.WriteHeader(status)
			})))
			t.Cleanup(srv.Close)
			for attempt := range 2 {
				a := send(t, srv.URL+"/o?status=201", "k201", "{}")
				if a.status != 500 || a.code != idem.CodeTxAborted || a.retry != "" {
					t.Fatalf("attempt %d: %+v, want 500 %s without Retry-After", attempt, a, idem.CodeTxAborted)
				}
			}
			for attempt := range 2 {
				a := send(t, srv.URL+"/o?status=409", "k409", "{}")
				if a.status != 409 || a.replayed != (attempt == 1) {
					t.Fatalf("attempt %d: %+v, want the handler's 409, replayed the second time", attempt, a)
				}
			}
			if n := runs.Load(); n != 3 {
				t.Fatalf("the handler ran %d times, want 3", n)
			}
			var n int
			if err := db.QueryRow("SELECT count(*) FROM children_" + suffix).Scan(&n); err != nil || n != 0 {
				t.Fatalf("%d rows committed (%v), want 0", n, err)
			}
		})
	}
}

// TestUnknownFingerprintVersionSingleTx: in the single-transaction flow too, a
// record whose fingerprint version idem has no algorithm for (a custom
// FingerprintFunc of another route) is a 422, never a replay.
func TestUnknownFingerprintVersionSingleTx(t *testing.T) {
	t.Parallel()
	s := newStore(t, openDB(t))
	custom := func(r *http.Request, body []byte) string {
		sum := sha256.Sum256(body)
		return "acme1:" + hex.EncodeToString(sum[:])
	}
	var runs atomic.Int64
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "%s %d", r.URL.Path, runs.Add(1))
	})
	charge, err := idem.New(s, &idem.Config{Flow: idem.FlowSingleTx, FingerprintFunc: custom})
	if err != nil {
		t.Fatal(err)
	}
	refund, err := idem.New(s, &idem.Config{Flow: idem.FlowSingleTx})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /charge", charge(h))
	mux.Handle("POST /refund", refund(h))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	if a := send(t, srv.URL+"/charge", "k1", "{}"); a.status != 201 {
		t.Fatalf("charge: %+v", a)
	}
	if a := send(t, srv.URL+"/refund", "k1", "{}"); a.status != 422 || a.code != idem.CodeKeyReused {
		t.Fatalf("refund with the charge's key: %+v, want 422 %s", a, idem.CodeKeyReused)
	}
	if n := runs.Load(); n != 1 {
		t.Fatalf("handlers ran %d times, want 1", n)
	}
}
