package pgstore_test

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Environment of the crash test's child process.
const (
	envCrashChild = "PGSTORE_CRASH_CHILD" // "1" in the child
	envCrashTable = "PGSTORE_CRASH_TABLE"
	envCrashOrder = "PGSTORE_CRASH_ORDERS"
	envCrashFlow  = "PGSTORE_CRASH_FLOW"
	childPrefix   = "PGSTORE_CHILD "
	crashLease    = 3 * time.Second
)

// TestCrashChild is the child process of TestCrash: it serves the idem-wrapped
// order handler, which inserts the order, says so on stdout and blocks until the
// parent kills the process. It does nothing in a normal test run.
func TestCrashChild(t *testing.T) {
	if os.Getenv(envCrashChild) != "1" {
		t.Skip("the child process of TestCrash; runs only when started by it")
	}
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	store, err := pgstore.New(pool, &pgstore.Config{Table: os.Getenv(envCrashTable)})
	if err != nil {
		t.Fatal(err)
	}
	flow, _ := strconv.Atoi(os.Getenv(envCrashFlow))
	app := &orderApp{store: store, orders: os.Getenv(envCrashOrder)}
	h := app.handler("child", func(context.Context) {
		fmt.Println(childPrefix + "inserted")
		select {} // inside the transaction until SIGKILL
	})
	mw, err := idem.New(store, &idem.Config{Flow: idem.Flow(flow), Lease: crashLease})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println(childPrefix + "listen " + ln.Addr().String())
	t.Fatal(http.Serve(ln, mw(h)))
}

// TestCrash kills a server process with SIGKILL while its handler is inside the
// transaction, then retries the request at a fresh server: the order the dead
// process inserted is gone, the retry executes once (after the lease lapses in
// the claim-then-complete flow, at once in the single-transaction flow), and
// exactly one order exists at the end.
func TestCrash(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process and waits for a lease to lapse")
	}
	t.Parallel()
	for _, fl := range flows {
		t.Run(fl.name, func(t *testing.T) {
			t.Parallel()
			testCrash(t, fl.flow)
		})
	}
}

func testCrash(t *testing.T, flow idem.Flow) {
	db := newTestDB(t, 4)
	app := newOrderApp(t, db)
	key := "crash-" + randomHex(8)
	body := []byte(`{"item":"lamp"}`)

	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), envCrashChild+"=1", envCrashOrder+"="+app.orders, envCrashFlow+"="+strconv.Itoa(int(flow)), envCrashTable+"="+unquote(app.store.Table()))
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := make(chan string, 8)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if l, ok := strings.CutPrefix(sc.Text(), childPrefix); ok {
				lines <- l
			}
		}
		close(lines)
	}()
	next := func(what string) string {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("child exited before %s", what)
			}
			return l
		case <-time.After(60 * time.Second):
			t.Fatalf("child did not report %s within 60s", what)
		}
		return ""
	}
	addr, ok := strings.CutPrefix(next("its address"), "listen ")
	if !ok {
		t.Fatal("child did not report its address first")
	}
	go post("http://"+addr+"/orders", key, body) // never answered: the child dies
	if l := next("the insert"); l != "inserted" {
		t.Fatalf("child said %q, want inserted", l)
	}
	// The child's order exists, uncommitted, inside its transaction.
	if err := cmd.Process.Kill(); err != nil { // SIGKILL
		t.Fatal(err)
	}
	_ = cmd.Wait()
	killed := time.Now()

	var leaseUntil time.Time
	if flow == idem.FlowClaimComplete {
		rec, err := app.store.Get(context.Background(), "", key, time.Now())
		if err != nil || rec.State != idem.StateInFlight {
			t.Fatalf("after the kill the record is %+v, %v; want the dead holder's in-flight claim", rec, err)
		}
		leaseUntil = rec.LeaseUntil
	}

	srv := httptest.NewServer(app.serve(t, &idem.Config{Flow: flow, Lease: crashLease}, app.handler("parent", nil)))
	defer srv.Close()
	var got answer
	conflicts := 0
	for {
		got = post(srv.URL+"/orders", key, body)
		if got.err != nil {
			t.Fatalf("retry: %v", got.err)
		}
		if got.status != http.StatusConflict {
			break
		}
		conflicts++
		if time.Since(killed) > 30*time.Second {
			t.Fatalf("retries still get 409 %s after the kill", time.Since(killed))
		}
		time.Sleep(100 * time.Millisecond)
	}
	took := time.Since(killed)
	t.Logf("retry executed %v after the kill, after %d 409 answers", took.Round(time.Millisecond), conflicts)
	if got.status != http.StatusCreated || got.replayed || !bytes.Contains(got.body, []byte(`"parent"`)) {
		t.Fatalf("retry = %d replayed=%v %s; want the parent's fresh 201", got.status, got.replayed, got.body)
	}
	switch flow {
	case idem.FlowClaimComplete:
		if conflicts == 0 {
			t.Error("the retry executed at once; want 409 while the dead holder's lease is live")
		}
		if now := time.Now(); now.Before(leaseUntil) {
			t.Errorf("the retry executed at %v, before the dead holder's lease lapsed at %v", now, leaseUntil)
		}
	case idem.FlowSingleTx:
		// The lock died with the connection; no lease to wait for.
		if took >= crashLease {
			t.Errorf("the retry took %v to execute, want well under a lease (%v): the advisory lock dies with the connection", took, crashLease)
		}
	}
	if n := app.ordersFor(t, key, ""); n != 1 {
		t.Fatalf("%d orders for the key, want exactly 1", n)
	}
	if n := app.ordersFor(t, key, "child"); n != 0 {
		t.Fatalf("the killed child's order survived (%d rows)", n)
	}
	rec, err := app.store.Get(context.Background(), "", key, time.Now())
	if err != nil || rec.State != idem.StateComplete || rec.Response == nil || !bytes.Equal(rec.Response.Body, got.body) {
		t.Fatalf("record at the end = %+v, %v; want complete with the parent's answer", rec, err)
	}
}

func unquote(quoted string) string { return strings.ReplaceAll(quoted, `"`, "") }
