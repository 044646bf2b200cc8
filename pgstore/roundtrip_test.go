package pgstore_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// wireCount counts, over every connection dialled through it, the round trips
// (a write that follows a read: the client waited for an answer before sending
// again) and the statements (Query and Execute messages) the client sent.
type wireCount struct {
	mu         sync.Mutex
	roundTrips int
	statements int
}

func (w *wireCount) reset() {
	w.mu.Lock()
	w.roundTrips, w.statements = 0, 0
	w.mu.Unlock()
}

func (w *wireCount) get() (roundTrips, statements int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.roundTrips, w.statements
}

func (w *wireCount) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &countedConn{Conn: c, w: w, readSince: true, startup: true}, nil
}

// countedConn is a net.Conn that feeds what it writes to its wireCount. It
// parses the frontend message stream: a type byte and an int32 length per
// message, after an untyped startup message.
type countedConn struct {
	net.Conn
	w         *wireCount
	mu        sync.Mutex
	readSince bool
	startup   bool
	skip      int
	hdr       []byte
}

func (c *countedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.mu.Lock()
		c.readSince = true
		c.mu.Unlock()
	}
	return n, err
}

func (c *countedConn) Write(p []byte) (int, error) {
	c.mu.Lock()
	c.w.mu.Lock()
	if c.readSince {
		c.readSince = false
		c.w.roundTrips++
	}
	for q := p; len(q) > 0; {
		if c.skip > 0 {
			n := min(c.skip, len(q))
			c.skip -= n
			q = q[n:]
			continue
		}
		need := 5
		if c.startup {
			need = 4
		}
		n := min(need-len(c.hdr), len(q))
		c.hdr = append(c.hdr, q[:n]...)
		q = q[n:]
		if len(c.hdr) < need {
			break
		}
		if c.startup {
			c.startup = false
			c.skip = int(binary.BigEndian.Uint32(c.hdr)) - 4
		} else {
			if t := c.hdr[0]; t == 'Q' || t == 'E' {
				c.w.statements++
			}
			c.skip = int(binary.BigEndian.Uint32(c.hdr[1:])) - 4
		}
		c.hdr = c.hdr[:0]
	}
	c.w.mu.Unlock()
	c.mu.Unlock()
	return c.Conn.Write(p)
}

// countedApp is an orders app whose store and handler use a pool of one
// connection dialled through a wireCount.
func countedApp(t *testing.T) (*orderApp, *wireCount) {
	t.Helper()
	db := newTestDB(t, 4)
	base := newOrderApp(t, db)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	w := &wireCount{}
	cfg.MaxConns, cfg.MinConns = 1, 1
	cfg.ConnConfig.DialFunc = w.dial
	pool, err := pgxpool.NewWithConfig(ctx30(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	store, err := pgstore.New(pool, &pgstore.Config{Table: strings.ReplaceAll(base.store.Table(), `"`, "")})
	if err != nil {
		t.Fatal(err)
	}
	return &orderApp{db: db, store: store, orders: base.orders}, w
}

// TestRoundTripsPerRequest counts, on the wire, the round trips and statements
// of a first-time request and of a replay, in the default flow and in each
// flow, with a handler that sends one statement (the order insert). The
// statements the first request of a connection prepares are not counted: the
// requests are warmed up on other keys first.
func TestRoundTripsPerRequest(t *testing.T) {
	type want struct{ firstRT, firstStmts, replayRT, replayStmts int }
	cases := []struct {
		name string
		flow idem.Flow
		want want
	}{
		// One transaction: BEGIN + lock + record read pipelined; the order
		// insert; the record insert + COMMIT pipelined. A replay: the first
		// batch, then ROLLBACK.
		{"Default", idem.FlowAuto, want{3, 6, 2, 4}},
		{"SingleTx", idem.FlowSingleTx, want{3, 6, 2, 4}},
		// The claim commits on its own (BEGIN, SET LOCAL, claim, COMMIT
		// pipelined); BEGIN; the order insert; completion + COMMIT pipelined.
		// A replay: the claim batch, which writes nothing.
		{"ClaimComplete", idem.FlowClaimComplete, want{4, 8, 1, 4}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			app, w := countedApp(t)
			h := app.serve(t, &idem.Config{Flow: tc.flow}, app.handler("rt", nil))
			do := func(key string, replay bool) {
				t.Helper()
				req := httptest.NewRequest(http.MethodPost, "/orders", bytes.NewReader([]byte(`{"item":"book"}`)))
				req.Header.Set("Idempotency-Key", key)
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				if rec.Code != http.StatusCreated || (rec.Header().Get(idem.ReplayedHeader) == "true") != replay {
					t.Fatalf("key %s: status %d, replayed %q: %s", key, rec.Code, rec.Header().Get(idem.ReplayedHeader), rec.Body)
				}
			}
			for i := range 3 { // prepare every statement on the connection
				k := "warm-" + string(rune('a'+i))
				do(k, false)
				do(k, true)
			}
			time.Sleep(10 * time.Millisecond) // let an asynchronous step of a warm-up finish
			w.reset()
			do("counted", false)
			rt, st := w.get()
			if rt != tc.want.firstRT || st != tc.want.firstStmts {
				t.Errorf("first-time request: %d round trips, %d statements; want %d, %d", rt, st, tc.want.firstRT, tc.want.firstStmts)
			}
			w.reset()
			do("counted", true)
			rt, st = w.get()
			if rt != tc.want.replayRT || st != tc.want.replayStmts {
				t.Errorf("replay: %d round trips, %d statements; want %d, %d", rt, st, tc.want.replayRT, tc.want.replayStmts)
			}
		})
	}
}
