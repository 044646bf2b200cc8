package bench

import (
	"bytes"
	"context"
	"database/sql"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testenv"
)

// startHand serves the hand-written reference on loopback, with tables of its own.
func startHand(t *testing.T) (url string, pool *pgxpool.Pool, orders string) {
	t.Helper()
	ctx := context.Background()
	pc, err := pgxpool.ParseConfig(testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	pc.MaxConns = 32
	pool, err = pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		t.Fatal(err)
	}
	suffix := randomHex(4)
	orders, keys := "orders_handtest_"+suffix, "hand_keys_handtest_"+suffix
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+orders+", "+keys)
		pool.Close()
	})
	if _, err := pool.Exec(ctx, "CREATE TABLE "+orders+" (id bigserial PRIMARY KEY, item text NOT NULL, qty integer NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	h, err := newHandOrders(ctx, pool, orders, keys)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String() + "/hand/orders", pool, orders
}

func postOrder(t *testing.T, client *http.Client, url, key string, body []byte) (int, bool, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		t.Error(err)
		return 0, false, ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true", string(b)
}

// TestHandOrdersConcurrentDuplicates sends 32 requests with one key at the same
// moment, over and over: the hand-written reference must execute exactly one of
// each, answer the others 409 or with the replay, and store one order per key.
func TestHandOrdersConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	url, pool, orders := startHand(t)
	concurrentDuplicates(t, url, func(ctx context.Context) (int, error) {
		var n int
		err := pool.QueryRow(ctx, "SELECT count(*) FROM "+orders).Scan(&n)
		return n, err
	})
}

// concurrentDuplicates is TestHandOrdersConcurrentDuplicates against the
// reference at url, whose orders count returns.
func concurrentDuplicates(t *testing.T, url string, count func(context.Context) (int, error)) {
	client := newClient(32)
	defer client.CloseIdleConnections()
	const rounds, dup = 10, 32
	kg := &keyGen{runID: randomHex(4)}
	for r := 0; r < rounds; r++ {
		key := kg.key(tagHot, int64(r))
		var wg sync.WaitGroup
		start := make(chan struct{})
		var mu sync.Mutex
		executed, replayed, conflicts := 0, 0, 0
		bodies := map[string]bool{}
		for i := 0; i < dup; i++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				status, rep, body := postOrder(t, client, url, key, orderBody)
				mu.Lock()
				defer mu.Unlock()
				switch {
				case status == http.StatusCreated && !rep:
					executed++
					bodies[body] = true
				case status == http.StatusCreated:
					replayed++
					bodies[body] = true
				case status == http.StatusConflict:
					conflicts++
				default:
					t.Errorf("key %s: status %d: %s", key, status, body)
				}
			}()
		}
		close(start)
		wg.Wait()
		if executed != 1 || len(bodies) != 1 {
			t.Errorf("key %s: %d executions (%d replays, %d 409s), %d distinct bodies; want exactly 1 execution and one body", key, executed, replayed, conflicts, len(bodies))
		}
		// After it completed, the key replays the same answer.
		status, rep, body := postOrder(t, client, url, key, orderBody)
		if status != http.StatusCreated || !rep || !bodies[body] {
			t.Errorf("key %s after completion: status %d, replayed %v, body %q; want the stored answer", key, status, rep, body)
		}
		if status, _, _ := postOrder(t, client, url, key, []byte(`{"item":"gadget","qty":2}`)); status != http.StatusUnprocessableEntity {
			t.Errorf("key %s with another body: status %d; want 422", key, status)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	n, err := count(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != rounds {
		t.Errorf("%d orders for %d keys; want one per key", n, rounds)
	}
}

// TestHandMySQLConcurrentDuplicates: the MariaDB reference, the same proof.
func TestHandMySQLConcurrentDuplicates(t *testing.T) {
	t.Parallel()
	dsn := testenv.MySQLDSN(testenv.MySQLURL(t))
	mc, err := mysql.ParseDSN(dsn)
	if err != nil {
		t.Fatal(err)
	}
	mc.MultiStatements = true
	db, err := sql.Open("mysql", mc.FormatDSN())
	if err != nil {
		t.Fatal(err)
	}
	db.SetMaxOpenConns(32)
	ctx := context.Background()
	if err := db.PingContext(ctx); err != nil {
		t.Fatal(err)
	}
	suffix := randomHex(4)
	orders, keys := "orders_handtest_"+suffix, "hand_keys_handtest_"+suffix
	t.Cleanup(func() {
		_, _ = db.Exec("DROP TABLE IF EXISTS " + orders + ", " + keys)
		_ = db.Close()
	})
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+orders+" (id BIGINT AUTO_INCREMENT PRIMARY KEY, item VARCHAR(255) NOT NULL, qty INT NOT NULL) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	h, err := newHandMySQL(ctx, db, orders, keys)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	concurrentDuplicates(t, "http://"+ln.Addr().String()+"/hand/orders", func(ctx context.Context) (int, error) {
		var n int
		err := db.QueryRowContext(ctx, "SELECT count(*) FROM "+orders).Scan(&n)
		return n, err
	})
}
