package sqlitestore_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// crashChildEnv, when set to a database path, turns the test binary into the
// child process of TestCrashInsideTransaction (see TestMain).
const crashChildEnv = "IDEM_SQLITESTORE_CRASH_CHILD"

// crashFlowEnv passes the idem.Flow to the child.
const crashFlowEnv = "IDEM_SQLITESTORE_CRASH_FLOW"

// crashLease is the lease of both the child and the parent server.
const crashLease = 3 * time.Second

func TestMain(m *testing.M) {
	if path := os.Getenv(crashChildEnv); path != "" {
		crashChild(path)
		os.Exit(3) // crashChild serves until it is killed
	}
	os.Exit(m.Run())
}

// crashChild serves the idem-wrapped order handler on the database at path. The
// handler inserts its order, says INSIDE on stdout, and blocks with its
// transaction open until the parent kills the process.
func crashChild(path string) {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "crash child:", err)
		os.Exit(2)
	}
	db, err := embedded.Open(path)
	if err != nil {
		fail(err)
	}
	store, err := sqlitestore.New(db, nil)
	if err != nil {
		fail(err)
	}
	flow := idem.FlowClaimComplete
	if os.Getenv(crashFlowEnv) == "single" {
		flow = idem.FlowSingleTx
	}
	mw, err := idem.New(store, &idem.Config{Lease: crashLease, Flow: flow})
	if err != nil {
		fail(err)
	}
	h := orderHandler(func(context.Context) {
		fmt.Println("INSIDE")
		select {} // until killed
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail(err)
	}
	fmt.Println("LISTEN", ln.Addr())
	fail(http.Serve(ln, mw(h)))
}

// A server process killed (SIGKILL) while its handler is inside its transaction
// leaves no order. In the claim-then-complete flow its key stays in flight: the
// retry is answered 409 until the dead holder's lease lapses, then it takes the
// key over and executes. In the single-transaction flow nothing of it remains
// and the retry executes at once. Either way: exactly one order in the end, and
// the key complete.
func TestCrashInsideTransaction(t *testing.T) {
	t.Parallel()
	t.Run("claim-complete", func(t *testing.T) { t.Parallel(); testCrash(t, idem.FlowClaimComplete) })
	t.Run("single-tx", func(t *testing.T) { t.Parallel(); testCrash(t, idem.FlowSingleTx) })
}

func testCrash(t *testing.T, flow idem.Flow) {
	single := flow == idem.FlowSingleTx
	path := t.TempDir() + "/crash.db"
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	createOrders(t, db)
	store, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}

	// The child: this test binary again, serving on the same file.
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), crashChildEnv+"="+path)
	if single {
		child.Env = append(child.Env, crashFlowEnv+"=single")
	}
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	killed := false
	t.Cleanup(func() {
		if !killed {
			_ = child.Process.Kill()
			_ = child.Wait()
		}
	})
	lines := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	next := func(want string) string {
		t.Helper()
		select {
		case l, ok := <-lines:
			if !ok || !strings.HasPrefix(l, want) {
				t.Fatalf("child said %q (open: %v), want %s…", l, ok, want)
			}
			return strings.TrimSpace(strings.TrimPrefix(l, want))
		case <-time.After(30 * time.Second):
			t.Fatalf("the child did not say %s within 30s", want)
		}
		return ""
	}
	addr := next("LISTEN")

	const key = "crash-key"
	go func() {
		// The first attempt: its connection dies with the child.
		req, _ := http.NewRequest(http.MethodPost, "http://"+addr, strings.NewReader(`{"item":"book"}`))
		req.Header.Set("Idempotency-Key", key)
		c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
		if resp, err := c.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
	}()
	next("INSIDE")
	// The order is inserted, its transaction open: kill the child now.
	if err := child.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed = true
	_ = child.Wait()

	if got := countOrders(t, db); got != 0 {
		t.Fatalf("%d orders after the crash, want 0: the child's transaction never committed", got)
	}
	rec, err := store.Get(context.Background(), "", key, time.Now())
	if single {
		if !errors.Is(err, idem.ErrNotFound) {
			t.Fatalf("the crashed request's key: %+v, %v; want nothing stored (ErrNotFound)", rec, err)
		}
		// A placeholder lease that has already lapsed: the retry may run at once.
		rec = &idem.Record{State: idem.StateInFlight, LeaseUntil: time.Now()}
	} else if err != nil {
		t.Fatalf("the crashed request's key: %v; want it in flight", err)
	}
	if rec.State != idem.StateInFlight {
		t.Fatalf("the crashed request's key is %v, want in flight", rec.State)
	}
	lapses := rec.LeaseUntil
	if !single && time.Until(lapses) < 500*time.Millisecond {
		t.Fatalf("the dead holder's lease lapses in %v; the test is too slow to see the 409 before it", time.Until(lapses))
	}

	var takenOver atomic.Int32
	srv := serve(t, store, &idem.Config{Lease: crashLease, Flow: flow, Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		if e.Kind == idem.EventTakenOver {
			takenOver.Add(1)
		}
	})}, orderHandler(nil))
	conflicts := 0
	deadline := time.Now().Add(crashLease + 30*time.Second)
	var done answer
	for {
		if time.Now().After(deadline) {
			t.Fatalf("the retry was not executed %v after the dead holder's lease lapsed", time.Since(lapses))
		}
		a := post(t, srv.URL, key, "book")
		answered := time.Now()
		if a.status == http.StatusConflict {
			if problemCode(a.body) != idem.CodeKeyInUse || a.header.Get("Retry-After") == "" {
				t.Fatalf("409 %s (Retry-After %q), want %s with Retry-After", a.body, a.header.Get("Retry-After"), idem.CodeKeyInUse)
			}
			conflicts++
			time.Sleep(200 * time.Millisecond)
			continue
		}
		if a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "" {
			t.Fatalf("retry = %d %s, want 409 until the lease lapses, then a fresh 201", a.status, a.body)
		}
		if answered.Before(lapses) {
			t.Fatalf("the retry executed at %v, before the dead holder's lease lapsed at %v", answered, lapses)
		}
		done = a
		break
	}
	switch {
	case single && conflicts != 0:
		t.Fatalf("%d retries were answered 409 after the crash; in the single-transaction flow the crash frees the key at once", conflicts)
	case !single && conflicts == 0:
		t.Fatal("no retry was answered 409 while the dead holder's lease was live")
	case !single && takenOver.Load() != 1:
		t.Errorf("%d takeovers observed, want 1", takenOver.Load())
	}
	if got := countOrders(t, db); got != 1 {
		t.Fatalf("%d orders, want exactly 1", got)
	}
	rec, err = store.Get(context.Background(), "", key, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if rec.State != idem.StateComplete || rec.Response.Status != http.StatusCreated || string(rec.Response.Body) != done.body {
		t.Fatalf("record = %v %d %q, want complete with the 201", rec.State, rec.Response.Status, rec.Response.Body)
	}
	if a := post(t, srv.URL, key, "book"); a.status != http.StatusCreated || a.header.Get(idem.ReplayedHeader) != "true" || a.body != done.body {
		t.Errorf("a later retry = %d %q, want the replayed 201", a.status, a.body)
	}
	t.Logf("%d retries answered 409 before the lease lapsed; then executed once", conflicts)
}
