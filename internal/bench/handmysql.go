package bench

import (
	"bytes"
	"context"
	"crypto/sha256"
	"database/sql"
	"database/sql/driver"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/go-sql-driver/mysql"
)

// handMySQL is the reference idem is measured against on MariaDB/MySQL: the
// orders handler made idempotent by hand with go-sql-driver, the shortest
// correct transaction, three round trips for a first-time key (the DSN needs
// multiStatements; every value is sent as a hex literal, so it needs no
// interpolateParams and no prepared statement):
//
//  1. START TRANSACTION; INSERT of the key row (fingerprint, no answer yet) —
//     one round trip. The row's lock is the in-flight signal: a duplicate's
//     INSERT waits for it (up to innodb_lock_wait_timeout), then fails with a
//     duplicate key (1062) once the first commits, and reads the answer: a
//     replay, or 422 for another body.
//  2. INSERT the order (the handler's own statement).
//  3. UPDATE the key row with the answer; COMMIT — one round trip.
//
// A crash anywhere rolls the whole transaction back, so there is no lease, no
// renewal and no takeover. Answers are kept forever and only the body and
// Location are stored: the features idem has that this does not.
type handMySQL struct {
	db           *sql.DB
	orders, keys string
}

// newHandMySQL creates the key table (orders must exist) and returns the handler.
func newHandMySQL(ctx context.Context, db *sql.DB, orders, keys string) (*handMySQL, error) {
	_, err := db.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+keys+` (
		k VARBINARY(255) PRIMARY KEY,
		fingerprint BINARY(32) NOT NULL,
		status INT NOT NULL DEFAULT 0,
		location VARBINARY(255) NOT NULL DEFAULT '',
		body BLOB,
		created_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)) ENGINE=InnoDB`)
	if err != nil {
		return nil, fmt.Errorf("create the hand-written reference's key table: %w", err)
	}
	return &handMySQL{db: db, orders: orders, keys: keys}, nil
}

func hexLit(b []byte) string { return "X'" + hex.EncodeToString(b) + "'" }

func (h *handMySQL) ServeHTTP(w http.ResponseWriter, r *http.Request) {
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
	conn, err := h.db.Conn(ctx)
	if err != nil {
		http.Error(w, "database: "+err.Error(), http.StatusServiceUnavailable)
		return
	}
	defer conn.Close()
	kl := hexLit([]byte(key))
	inTx := false
	fail := func(status int, msg string) {
		if inTx {
			mysqlRollbackOrClose(conn)
		}
		http.Error(w, msg, status)
	}

	// 1. Begin and claim the key: one round trip.
	_, err = conn.ExecContext(ctx, "START TRANSACTION; INSERT INTO "+h.keys+" (k, fingerprint) VALUES ("+kl+", "+hexLit(fp[:])+")")
	var me *mysql.MySQLError
	switch {
	case errors.As(err, &me) && me.Number == 1062:
		// Stored by an earlier request (which committed): answer from it.
		mysqlRollbackOrClose(conn)
		var storedFP, storedLoc, storedBody []byte
		var storedStatus int
		err := conn.QueryRowContext(ctx, "SELECT fingerprint, status, location, body FROM "+h.keys+" WHERE k = "+kl).Scan(&storedFP, &storedStatus, &storedLoc, &storedBody)
		if err != nil {
			http.Error(w, "read the stored answer: "+err.Error(), http.StatusInternalServerError)
			return
		}
		if !bytes.Equal(storedFP, fp[:]) {
			http.Error(w, "this Idempotency-Key was used with another request", http.StatusUnprocessableEntity)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", string(storedLoc))
		w.Header().Set("Idempotent-Replayed", "true")
		w.WriteHeader(storedStatus)
		_, _ = w.Write(storedBody)
		return
	case errors.As(err, &me) && (me.Number == 1205 || me.Number == 1213): // lock wait timeout, deadlock
		mysqlRollbackOrClose(conn)
		w.Header().Set("Retry-After", "1")
		http.Error(w, "a request with this Idempotency-Key is in progress", http.StatusConflict)
		return
	case err != nil:
		inTx = true
		fail(http.StatusInternalServerError, "claim: "+err.Error())
		return
	}
	inTx = true

	// 2. The handler's own work: insert the order.
	res, err := conn.ExecContext(ctx, "INSERT INTO "+h.orders+" (item, qty) VALUES ("+hexLit([]byte(in.Item))+", "+strconv.Itoa(in.Qty)+")")
	var id int64
	if err == nil {
		id, err = res.LastInsertId()
	}
	if err != nil {
		fail(http.StatusInternalServerError, "insert order: "+err.Error())
		return
	}
	body, _ := json.Marshal(order{ID: id, Item: in.Item, Qty: in.Qty})
	loc := "/orders/" + strconv.FormatInt(id, 10)

	// 3. Store the answer and commit: one round trip.
	_, err = conn.ExecContext(ctx, "UPDATE "+h.keys+" SET status = "+strconv.Itoa(http.StatusCreated)+", location = "+hexLit([]byte(loc))+
		", body = "+hexLit(body)+" WHERE k = "+kl+"; COMMIT")
	if err != nil {
		// The outcome of the COMMIT may be unknown: close the connection, which
		// rolls back whatever did not commit.
		_ = conn.Raw(func(any) error { return mysqlDriverBad })
		http.Error(w, "store the answer and commit: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", loc)
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write(body)
}

// mysqlDriverBad returned from sql.Conn.Raw makes database/sql close the
// connection instead of returning it to the pool.
var mysqlDriverBad = driver.ErrBadConn

// mysqlRollbackOrClose ends the connection's transaction; a connection that
// cannot roll back is closed.
func mysqlRollbackOrClose(conn *sql.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := conn.ExecContext(ctx, "ROLLBACK"); err != nil {
		_ = conn.Raw(func(any) error { return mysqlDriverBad })
	}
}
