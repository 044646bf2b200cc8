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
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
	"github.com/idemkit/idem/outbox"
)

const (
	envCrashChild = "MYSQLOUTBOX_CRASH_CHILD" // "records outbox" tables
	crashLine     = "MYSQLOUTBOX_CHILD "
	crashLease    = 2 * time.Second
)

func crashService(t *testing.T, db *sql.DB, records, obTable, who string, after func()) http.Handler {
	t.Helper()
	store, err := mysqlstore.New(db, &mysqlstore.Config{Table: records})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := mysqloutbox.New(db, &mysqloutbox.Config{Table: obTable})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := idem.New(store, &idem.Config{Lease: crashLease})
	if err != nil {
		t.Fatal(err)
	}
	return mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for _, name := range []string{"order.created", "invoice.requested"} {
			_, key, _ := idem.KeyFrom(r.Context())
			if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: name, Subject: "orders", Payload: []byte(who + ":" + key)}); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
		}
		if after != nil {
			after()
		}
		w.WriteHeader(http.StatusCreated)
	}))
}

// TestCrashChild is the child of TestTakeoverAfterCrash.
func TestCrashChild(t *testing.T) {
	spec := os.Getenv(envCrashChild)
	if spec == "" {
		t.Skip("the child process of TestTakeoverAfterCrash")
	}
	records, obTable, _ := strings.Cut(spec, " ")
	h := crashService(t, testDB(t), records, obTable, "child", func() {
		fmt.Println(crashLine + "enqueued")
		select {}
	})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println(crashLine + "listen " + ln.Addr().String())
	t.Fatal(http.Serve(ln, h))
}

// TestTakeoverAfterCrash: on MariaDB, a server process is SIGKILLed after its
// handler enqueued two events inside idem's transaction; the retry at a
// fresh server takes the key over: the outbox holds the survivor's events
// only, under the same IDs.
func TestTakeoverAfterCrash(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process and waits for a lease to lapse")
	}
	ctx := context.Background()
	db := testDB(t)
	ob := newOutbox(t, db)
	records := "records_" + randHex(5)
	store, err := mysqlstore.New(db, &mysqlstore.Config{Table: records})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.Exec("DROP TABLE IF EXISTS " + records + ", " + records + "_migrations, " + records + "_steps")
	})
	obTable := strings.Trim(ob.Table(), "`")
	key := "crash-" + randHex(6)
	cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), envCrashChild+"="+records+" "+obTable)
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			if l, ok := strings.CutPrefix(sc.Text(), crashLine); ok {
				lines <- l
			}
		}
		close(lines)
	}()
	next := func() string {
		select {
		case l := <-lines:
			return l
		case <-time.After(60 * time.Second):
			t.Fatal("the child said nothing for 60 s")
		}
		return ""
	}
	addr, ok := strings.CutPrefix(next(), "listen ")
	if !ok {
		t.Fatal("no address from the child")
	}
	go func() { _, _ = post("http://"+addr, key) }()
	if l := next(); l != "enqueued" {
		t.Fatalf("child said %q", l)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: crashService(t, db, records, obTable, "survivor", nil)}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	deadline := time.Now().Add(60 * time.Second)
	for {
		code, err := post("http://"+ln.Addr().String(), key)
		if err != nil {
			t.Fatal(err)
		}
		if code == http.StatusCreated {
			break
		}
		if code != http.StatusConflict || time.Now().After(deadline) {
			t.Fatalf("retry: %d", code)
		}
		time.Sleep(100 * time.Millisecond)
	}
	rows, err := db.Query("SELECT id, payload FROM " + ob.Table() + " ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var got []string
	for rows.Next() {
		var id, p string
		if err := rows.Scan(&id, &p); err != nil {
			t.Fatal(err)
		}
		got = append(got, id+"="+p)
	}
	want := []string{
		outbox.MessageID("", key, "order.created") + "=survivor:" + key,
		outbox.MessageID("", key, "invoice.requested") + "=survivor:" + key,
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("outbox holds %v, want the survivor's %v", got, want)
	}
}
