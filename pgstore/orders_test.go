package pgstore_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
)

// orderApp is a small service whose handler writes an order in the
// transaction idem opened (pgstore.Tx).
type orderApp struct {
	db     *testDB
	store  *pgstore.Store
	orders string // quoted table name
}

func newOrderApp(t testing.TB, db *testDB) *orderApp {
	t.Helper()
	a := &orderApp{db: db, store: db.newStore(t)}
	a.orders = pgx.Identifier{db.schema, fmt.Sprintf("orders_%d", db.n.Add(1))}.Sanitize()
	db.exec(t, `CREATE TABLE `+a.orders+` (id bigserial PRIMARY KEY, idem_key text NOT NULL, tag text NOT NULL)`)
	return a
}

// handler inserts one order tagged tag through pgstore.Tx, calls hook (if any)
// while the transaction is open, and answers 201 with the order.
func (a *orderApp) handler(tag string, hook func(ctx context.Context)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx := pgstore.Tx(ctx)
		if tx == nil {
			http.Error(w, "no transaction in the request context", http.StatusInternalServerError)
			return
		}
		_, key, _ := idem.KeyFrom(ctx)
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO `+a.orders+` (idem_key, tag) VALUES ($1, $2) RETURNING id`, key, tag).Scan(&id); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if hook != nil {
			hook(ctx)
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"id": id, "tag": tag})
	})
}

// serve wraps h in idem with cfg.
func (a *orderApp) serve(t testing.TB, cfg *idem.Config, h http.Handler) http.Handler {
	t.Helper()
	mw, err := idem.New(a.store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return mw(h)
}

// ordersFor counts the orders written under key, optionally with one tag.
func (a *orderApp) ordersFor(t testing.TB, key, tag string) int {
	t.Helper()
	if tag == "" {
		return a.db.count(t, `SELECT count(*) FROM `+a.orders+` WHERE idem_key = $1`, key)
	}
	return a.db.count(t, `SELECT count(*) FROM `+a.orders+` WHERE idem_key = $1 AND tag = $2`, key, tag)
}

// answer is one HTTP exchange.
type answer struct {
	status   int
	replayed bool
	header   http.Header
	body     []byte
	err      error
}

// post sends one POST on a fresh connection (never retried by the transport).
func post(url, key string, body []byte) answer {
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	defer client.CloseIdleConnections()
	req, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return answer{err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return answer{err: err}
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, replayed: resp.Header.Get(idem.ReplayedHeader) == "true", header: resp.Header, body: b, err: err}
}

// problemCode returns the "code" member of a problem body.
func problemCode(body []byte) string {
	var p struct {
		Code string `json:"code"`
	}
	_ = json.Unmarshal(body, &p)
	return p.Code
}

var flows = []struct {
	name string
	flow idem.Flow
}{
	{"ClaimComplete", idem.FlowClaimComplete},
	{"SingleTx", idem.FlowSingleTx},
}
