package pgstore_test

import (
	"bytes"
	"context"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// dropProxy forwards connections to PostgreSQL. Once armed, the first message
// from a client that contains marker is forwarded, and then the client's
// connection is closed without the answer, while the server's side is drained
// to its end: the statement runs (and commits) on the server, and the client
// never learns it did; dropped is closed once the server answered it all.
type dropProxy struct {
	ln      net.Listener
	target  string
	marker  []byte
	armed   atomic.Bool
	delay   time.Duration // the dropped query reaches the server this long after the client's connection closed
	dropped chan struct{} // closed once the server finished the dropped query
	once    sync.Once
}

func newDropProxy(t *testing.T, target string, marker string) *dropProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &dropProxy{ln: ln, target: target, marker: []byte(marker), dropped: make(chan struct{})}
	t.Cleanup(func() { _ = ln.Close() })
	go p.serve()
	return p
}

func (p *dropProxy) serve() {
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		go p.pipe(c)
	}
}

func (p *dropProxy) pipe(client net.Conn) {
	server, err := net.Dial("tcp", p.target)
	if err != nil {
		_ = client.Close()
		return
	}
	var dropping atomic.Bool
	go func() { // server → client; once dropping, swallowed up to ReadyForQuery
		buf := make([]byte, 32<<10)
		var pending []byte
		for {
			n, err := server.Read(buf)
			if n > 0 && !dropping.Load() {
				if _, werr := client.Write(buf[:n]); werr != nil && !dropping.Load() {
					_ = server.Close()
					return
				}
			} else if n > 0 {
				// The answers to the dropped query: messages of a type byte and
				// a length; ReadyForQuery ('Z') ends them, the query is done.
				pending = append(pending, buf[:n]...)
				for len(pending) >= 5 {
					l := int(pending[1])<<24 | int(pending[2])<<16 | int(pending[3])<<8 | int(pending[4])
					if len(pending) < 1+l {
						break
					}
					if pending[0] == 'Z' {
						_ = server.Close()
						p.once.Do(func() { close(p.dropped) })
						return
					}
					pending = pending[1+l:]
				}
			}
			if err != nil {
				_ = client.Close()
				return
			}
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := client.Read(buf)
		if n > 0 {
			drop := p.armed.Load() && bytes.Contains(buf[:n], p.marker) && p.armed.CompareAndSwap(true, false)
			if drop {
				dropping.Store(true)
			}
			if drop && p.delay > 0 {
				_ = client.Close() // the client hears nothing; the query is still on its way
				time.Sleep(p.delay)
				_, _ = server.Write(buf[:n])
				return
			}
			if _, werr := server.Write(buf[:n]); werr != nil {
				_ = client.Close()
				return
			}
			if drop {
				_ = client.Close() // the answer never reaches the client
				return
			}
		}
		if err != nil {
			if !dropping.Load() {
				_ = server.Close()
			}
			return
		}
	}
}

// TestLostClaimAnswerIsReleased: PostgreSQL commits a claim whose answer is
// lost on the way back (a proxy forwards the claim and drops the connection).
// The client hears 503 "not executed"; the middleware gives the claim up,
// fenced by its token, so the retry runs the operation once — instead of 409
// for a whole lease and, under LapsedRefuse, 503 outcome-unknown until an
// operator resolves a key whose handler never ran.
func TestLostClaimAnswerIsReleased(t *testing.T) {
	t.Parallel()
	for _, delay := range []time.Duration{0, 300 * time.Millisecond} {
		t.Run("late-"+delay.String(), func(t *testing.T) {
			t.Parallel()
			testLostClaimAnswerIsReleased(t, delay)
		})
	}
}

// testLostClaimAnswerIsReleased: with delay, the claim reaches PostgreSQL only
// after its client heard the connection break (and would have released the
// claim before it landed, leaving the key held by nobody: 409 for the retry).
func testLostClaimAnswerIsReleased(t *testing.T, delay time.Duration) {
	db := newTestDB(t, 2)
	app := newOrderApp(t, db)
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	// The simple protocol sends the claim as one message that carries its text.
	cfg.ConnConfig.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	proxy := newDropProxy(t, net.JoinHostPort(cfg.ConnConfig.Host, itoa(int(cfg.ConnConfig.Port))), "WITH cur AS")
	proxy.delay = delay
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = "127.0.0.1", uint16(proxy.ln.Addr().(*net.TCPAddr).Port)
	cfg.ConnConfig.Fallbacks = nil
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	s, err := pgstore.New(pool, &pgstore.Config{Table: db.table("lost")})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx30(t)); err != nil {
		t.Fatal(err)
	}
	app.store = s
	srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: idem.FlowClaimComplete, LapsedLease: idem.LapsedRefuse}, app.handler("t", nil)))
	t.Cleanup(srv.Close)

	key := "lost-" + randomHex(4)
	proxy.armed.Store(true)
	a := post(srv.URL+"/orders", key, []byte("{}"))
	if a.err != nil || a.status != http.StatusServiceUnavailable || problemCode(a.body) != idem.CodeStoreUnavailable {
		t.Fatalf("first: %d %s %v, want 503 %s", a.status, a.body, a.err, idem.CodeStoreUnavailable)
	}
	if proxy.armed.Load() {
		t.Fatal("the claim never went through the proxy")
	}
	select {
	case <-proxy.dropped: // the server ran the dropped query to its end: the claim committed
	case <-time.After(30 * time.Second):
		t.Fatal("the server never finished the dropped claim")
	}
	b := post(srv.URL+"/orders", key, []byte("{}"))
	if b.err != nil || b.status != http.StatusCreated || b.replayed {
		t.Fatalf("retry: %d %s %v, want a fresh 201 (the lost claim was released)", b.status, b.body, b.err)
	}
	if n := app.ordersFor(t, key, ""); n != 1 {
		t.Fatalf("%d orders, want 1", n)
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
