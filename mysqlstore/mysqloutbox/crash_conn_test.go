package mysqloutbox_test

import (
	"bufio"
	"context"
	"database/sql"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
	"github.com/idemkit/idem/outbox"
)

const envCrashConnChild = "MYSQLOUTBOX_CRASH_CONN_CHILD"

// crashConnService is the order service of TestTakeoverAfterCrashConn, on the fast
// path (single-transaction flow, multiStatements, mysqlstore.Conn).
func crashConnService(t *testing.T, tables string, who string, hold bool) (url string, db *sql.DB) {
	t.Helper()
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t))+"&multiStatements=true&interpolateParams=true")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	store, err := mysqlstore.New(db, &mysqlstore.Config{Table: "records_" + tables})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := mysqloutbox.New(db, &mysqloutbox.Config{Table: "outbox_" + tables})
	if err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		q := mysqlstore.Conn(r.Context())
		_, key, _ := idem.KeyFrom(r.Context())
		if _, err := q.ExecContext(r.Context(), "INSERT INTO orders_"+tables+" (k, by_who) VALUES (?, ?)", key, who); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte(who)}); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if hold {
			fmt.Println("ENQUEUED")
			time.Sleep(time.Hour) // killed here
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw, err := idem.New(store, &idem.Config{Flow: idem.FlowSingleTx, Lease: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mw(h)}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String(), db
}

// TestCrashConnChild is the process TestTakeoverAfterCrashConn SIGKILLs.
func TestCrashConnChild(t *testing.T) {
	tables := os.Getenv(envCrashConnChild)
	if tables == "" {
		t.Skip("the child process of TestTakeoverAfterCrashConn")
	}
	url, _ := crashConnService(t, tables, "crashed", true)
	fmt.Println("URL " + url)
	time.Sleep(time.Hour)
}

// TestTakeoverAfterCrashConn: on the fast path, a process SIGKILLed after its
// handler enqueued, before the commit, leaves neither order nor event; the
// retry on another process makes the order and exactly its event.
func TestTakeoverAfterCrashConn(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills a process")
	}
	ctx := context.Background()
	tables := randHex(5)
	db := testDB(t)
	store, err := mysqlstore.New(db, &mysqlstore.Config{Table: "records_" + tables})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ob, err := mysqloutbox.New(db, &mysqloutbox.Config{Table: "outbox_" + tables})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Exec("CREATE TABLE orders_" + tables + " (k VARCHAR(255) PRIMARY KEY, by_who VARCHAR(32))"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.Exec("DROP TABLE IF EXISTS records_" + tables + ", records_" + tables + "_migrations, orders_" + tables + ", outbox_" + tables + ", outbox_" + tables + "_dead, outbox_" + tables + "_locks")
	})
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashConnChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), envCrashConnChild+"="+tables)
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	sc := bufio.NewScanner(out)
	var childURL string
	for sc.Scan() {
		if u, ok := strings.CutPrefix(sc.Text(), "URL "); ok {
			childURL = u
			break
		}
	}
	if childURL == "" {
		t.Fatal("the child did not start")
	}
	go func() { _, _ = post(childURL, "crash-1") }()
	enqueued := make(chan bool, 1)
	go func() {
		for sc.Scan() {
			if sc.Text() == "ENQUEUED" {
				enqueued <- true
				return
			}
		}
		enqueued <- false
	}()
	select {
	case ok := <-enqueued:
		if !ok {
			t.Fatal("the child ended before enqueuing")
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the child did not enqueue within 20 s")
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	url, _ := crashConnService(t, tables, "survivor", false)
	deadline := time.Now().Add(30 * time.Second)
	for {
		code, err := post(url, "crash-1")
		if err == nil && code == http.StatusCreated {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the retry: %d %v after 30 s", code, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	var who, payload string
	var n int
	if err := db.QueryRow("SELECT COUNT(*), MAX(by_who) FROM orders_"+tables).Scan(&n, &who); err != nil || n != 1 || who != "survivor" {
		t.Fatalf("orders: %d, by %q (%v); want the survivor's only", n, who, err)
	}
	if err := db.QueryRow("SELECT COUNT(*), MAX(payload) FROM "+ob.Table()+" WHERE id = ?", outbox.MessageID("", "crash-1", "order.created")).Scan(&n, &payload); err != nil || n != 1 || payload != "survivor" {
		t.Fatalf("events: %d, payload %q (%v); want the survivor's only", n, payload, err)
	}
	if err := db.QueryRow("SELECT COUNT(*) FROM " + ob.Table()).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d events in all (%v), want 1", n, err)
	}
}
