package mysqlstore_test

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// statementBinlogDB returns a pool on a server that writes a statement-based
// binary log. The configured test server has binary logging off (log_bin cannot
// be turned on at run time), so the test starts a private MariaDB of its own on
// a loopback port, in a temporary directory, and stops it at the end.
func statementBinlogServer(t *testing.T) string {
	t.Helper()
	server, err := exec.LookPath("mariadbd")
	if err != nil {
		server, err = exec.LookPath("/usr/sbin/mariadbd")
	}
	install, ierr := exec.LookPath("mariadb-install-db")
	if err != nil || ierr != nil {
		t.Skipf("mariadbd or mariadb-install-db not found (%v, %v): cannot start a server with a statement-based binary log", err, ierr)
	}
	dir := t.TempDir()
	data, tmp := filepath.Join(dir, "data"), filepath.Join(dir, "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		t.Fatal(err)
	}
	user := []string{}
	if os.Geteuid() == 0 {
		user = []string{"--user=root"}
	}
	args := append([]string{"--no-defaults", "--datadir=" + data, "--tmpdir=" + tmp, "--auth-root-authentication-method=normal", "--skip-test-db"}, user...)
	if out, err := exec.Command(install, args...).CombinedOutput(); err != nil {
		t.Fatalf("mariadb-install-db: %v\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	_ = l.Close()
	cmd := exec.Command(server, append([]string{"--no-defaults", "--datadir=" + data, "--tmpdir=" + tmp,
		fmt.Sprintf("--port=%d", port), "--bind-address=127.0.0.1", "--socket=" + filepath.Join(dir, "s.sock"),
		"--pid-file=" + filepath.Join(dir, "pid"), "--log-error=" + filepath.Join(dir, "err.log"),
		"--log-bin=" + filepath.Join(dir, "binlog"), "--server-id=1", "--binlog-format=STATEMENT",
		"--innodb-buffer-pool-size=16M", "--skip-name-resolve"}, user...)...)
	if err := cmd.Start(); err != nil {
		t.Fatalf("starting mariadbd: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(20 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	db, err := sql.Open("mysql", fmt.Sprintf("root@tcp(127.0.0.1:%d)/", port))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err = db.PingContext(ctx)
		cancel()
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(dir, "err.log"))
			t.Fatalf("the private mariadbd did not come up: %v\n%s", err, log)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if _, err := db.ExecContext(ctxFor(t), "CREATE DATABASE test"); err != nil {
		t.Fatal(err)
	}
	return fmt.Sprintf("root@tcp(127.0.0.1:%d)/test", port)
}

// binlogPool opens a pool of at most maxConns connections on dsn.
func binlogPool(t *testing.T, dsn string, maxConns int) *sql.DB {
	t.Helper()
	if m := modeDSN(t); m != "" {
		dsn += "?" + m[1:]
	}
	pool, err := sql.Open("mysql", dsn)
	if err != nil {
		t.Fatal(err)
	}
	pool.SetMaxOpenConns(maxConns)
	t.Cleanup(func() { _ = pool.Close() })
	var logBin int
	var format string
	if err := pool.QueryRowContext(ctxFor(t), "SELECT @@log_bin, @@binlog_format").Scan(&logBin, &format); err != nil || logBin != 1 || format != "STATEMENT" {
		t.Fatalf("the private server has log_bin = %d, binlog_format = %q (%v), want 1, STATEMENT", logBin, format, err)
	}
	return pool
}

// With a statement-based binary log, InnoDB refuses writes under READ COMMITTED
// (error 1665); the store's transactions must not be READ COMMITTED there, or
// every keyed request fails.
// TestStatementBinlog runs testStatementBinlog with and without multiStatements (see bothModes).
func TestStatementBinlog(t *testing.T) { bothModes(t, testStatementBinlog) }

func testStatementBinlog(t *testing.T) {
	dsn := statementBinlogServer(t)
	t.Run("requests", func(t *testing.T) { testStatementBinlogRequests(t, dsn) })
	t.Run("format switched later", func(t *testing.T) { testStatementBinlogLater(t, dsn) })
}

func testStatementBinlogRequests(t *testing.T, dsn string) {
	db := binlogPool(t, dsn, 8)
	s := newStore(t, db)
	orders := ordersTable(t, db)
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		srv := newServer(t, s, &idem.Config{Flow: flow}, orderHandler(orders, nil))
		key := randomName("key-")
		item := fmt.Sprintf("binlog-%d", flow)
		for attempt := range 2 {
			req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"item":"`+item+`"}`))
			req.Header.Set("Idempotency-Key", key)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusCreated || (resp.Header.Get("Idempotent-Replayed") == "true") != (attempt == 1) {
				t.Fatalf("flow %d attempt %d: %d %s, want 201 (replayed the second time)", flow, attempt, resp.StatusCode, b)
			}
		}
		if n := countOrders(t, db, orders, item); n != 1 {
			t.Fatalf("flow %d: %d orders, want 1", flow, n)
		}
	}
}

// A session switched to the statement-based format after the store looked: the
// completion fails with an error that says why, nothing commits, and the store's
// later transactions work.
func testStatementBinlogLater(t *testing.T, dsn string) {
	db := binlogPool(t, dsn, 1) // one connection: the session the store looked at
	s := newStore(t, db)
	ctx := ctxFor(t)
	if _, err := db.ExecContext(ctx, "SET SESSION binlog_format = 'MIXED'"); err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	complete := func(key string) error {
		req := claimReq("t", key, "v1:b", now)
		if _, claimed, err := s.Claim(ctx, req); err != nil || !claimed {
			t.Fatalf("Claim = %v, %v", claimed, err)
		}
		_, tx, err := s.BeginTx(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer tx.Rollback(ctx)
		if err := tx.Complete(ctx, req.Scope, req.Key, req.Token, &idem.Response{Status: 200}, now, now.Add(time.Hour)); err != nil {
			return err
		}
		return tx.Commit(ctx)
	}
	if err := complete("mixed"); err != nil {
		t.Fatalf("under MIXED: %v", err)
	}
	if _, err := db.ExecContext(ctx, "SET SESSION binlog_format = 'STATEMENT'"); err != nil {
		t.Fatal(err)
	}
	err := complete("switched")
	if err == nil || !strings.Contains(err.Error(), "REPEATABLE READ") {
		t.Fatalf("completion after the switch = %v, want an error that explains the binary log format", err)
	}
	if rec, err := s.Get(ctx, "t", "switched", now); err != nil || rec.State != idem.StateInFlight {
		t.Fatalf("record after the refused completion = %+v, %v; want in flight", rec, err)
	}
	if err := complete("after"); err != nil {
		t.Fatalf("the next transaction: %v", err)
	}
}
