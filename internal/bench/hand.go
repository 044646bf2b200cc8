package bench

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// handOrders is the reference idem is measured against on PostgreSQL: the same
// orders handler made idempotent by hand with pgx, the way a skilled engineer
// would write it for this one endpoint, with no library. One transaction per
// request, three round trips for a first-time key:
//
//  1. BEGIN; SELECT pg_try_advisory_xact_lock(hashtextextended(key, 0));
//     SELECT the stored answer — one pipelined batch. The lock is the in-flight
//     signal: a duplicate that does not get it answers 409 at once. Whoever holds
//     it reads the key row with a snapshot taken after it got the lock, so it sees
//     the answer of any earlier holder (which committed before releasing it).
//  2. INSERT the order … RETURNING id (the handler's own statement).
//  3. INSERT the key row with the answer; COMMIT — one pipelined batch.
//
// A crash anywhere rolls the whole transaction back and releases the lock, so
// there is no lease, no renewal and no takeover to write. A reused key with
// another body is answered 422. Answers are kept forever (no expiry, no
// janitor), and only the body and Location are stored: the features idem has
// that this does not.
type handOrders struct {
	pool         *pgxpool.Pool
	orders, keys string
	lookup       string
	insertKey    string
	insertOrder  string
}

// newHandOrders creates the key table (orders must exist) and returns the handler.
func newHandOrders(ctx context.Context, pool *pgxpool.Pool, orders, keys string) (*handOrders, error) {
	_, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+keys+` (
		key text PRIMARY KEY,
		fingerprint bytea NOT NULL,
		status integer NOT NULL,
		location text NOT NULL,
		body bytea NOT NULL,
		created_at timestamptz NOT NULL DEFAULT now())`)
	if err != nil {
		return nil, fmt.Errorf("create the hand-written reference's key table: %w", err)
	}
	return &handOrders{
		pool: pool, orders: orders, keys: keys,
		lookup:      "SELECT fingerprint, status, location, body FROM " + keys + " WHERE key = $1",
		insertKey:   "INSERT INTO " + keys + " (key, fingerprint, status, location, body) VALUES ($1, $2, $3, $4, $5)",
		insertOrder: "INSERT INTO " + orders + " (item, qty) VALUES ($1, $2) RETURNING id",
	}, nil
}

func (h *handOrders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("Idempotency-Key")
	if key == "" || len(key) > 255 {
		http.Error(w, "send an Idempotency-Key header of 1 to 255 characters", http.StatusBadRequest)
		return
	}
	raw, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		http.Error(w, "read the body: "+err.Error(), http.StatusBadRequest)
		return
	}
	var in struct {
		Item string `json:"item"`
		Qty  int    `json:"qty"`
	}
	if err := json.Unmarshal(raw, &in); err != nil || in.Item == "" || in.Qty < 1 {
		http.Error(w, "want {\"item\": \"…\", \"qty\": n}", http.StatusBadRequest)
		return
	}
	fp := sha256.Sum256(raw)
	ctx := r.Context()
	conn, err := h.pool.Acquire(ctx)
	if err != nil {
		http.Error(w, "database: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	defer conn.Release()
	inTx := false
	fail := func(status int, msg string) {
		if inTx {
			rollbackOrClose(conn)
		}
		http.Error(w, msg, status)
	}

	// 1. Begin, take the in-flight lock, read a stored answer: one round trip.
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))", key)
	b.Queue(h.lookup, key)
	br := conn.SendBatch(ctx, b)
	_, err = br.Exec()
	inTx = err == nil
	var locked, found bool
	var storedFP, storedBody []byte
	var storedStatus int
	var storedLoc string
	if err == nil {
		err = br.QueryRow().Scan(&locked)
	}
	if err == nil {
		err = br.QueryRow().Scan(&storedFP, &storedStatus, &storedLoc, &storedBody)
		found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		fail(http.StatusInternalServerError, "claim: "+err.Error())
		return
	}
	switch {
	case !locked:
		rollbackOrClose(conn)
		w.Header().Set("Retry-After", "1")
		http.Error(w, "a request with this Idempotency-Key is in progress", http.StatusConflict)
		return
	case found:
		rollbackOrClose(conn)
		if !bytes.Equal(storedFP, fp[:]) {
			http.Error(w, "this Idempotency-Key was used with another request", http.StatusUnprocessableEntity)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", storedLoc)
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(storedStatus)
		_, _ = w.Write(storedBody)
		return
	}

	// 2. The handler's own work: insert the order.
	var id int64
	if err := conn.QueryRow(ctx, h.insertOrder, in.Item, in.Qty).Scan(&id); err != nil {
		fail(http.StatusInternalServerError, "insert order: "+err.Error())
		return
	}
	body, _ := json.Marshal(order{ID: id, Item: in.Item, Qty: in.Qty})
	loc := "/orders/" + strconv.FormatInt(id, 10)

	// 3. Store the answer and commit: one round trip.
	b = &pgx.Batch{}
	b.Queue(h.insertKey, key, fp[:], http.StatusCreated, loc, body)
	b.Queue("COMMIT")
	br = conn.SendBatch(ctx, b)
	_, err = br.Exec()
	if err == nil {
		_, err = br.Exec()
	}
	if cerr := br.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		fail(http.StatusInternalServerError, "store the answer and commit: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", loc)
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(body)
}

// rollbackOrClose ends the connection's transaction; a connection that cannot
// roll back is closed, so that the pool never hands out one in a transaction.
func rollbackOrClose(conn *pgxpool.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := conn.Exec(ctx, "ROLLBACK"); err != nil {
		_ = conn.Conn().Close(ctx)
	}
}
