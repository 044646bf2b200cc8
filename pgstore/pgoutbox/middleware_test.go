package pgoutbox_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

const (
	envChild   = "PGOUTBOX_CRASH_CHILD"
	envSchema  = "PGOUTBOX_CRASH_SCHEMA"
	envFlow    = "PGOUTBOX_CRASH_FLOW"
	childLine  = "PGOUTBOX_CHILD "
	crashLease = 2 * time.Second
)

// service is the order service of these tests: the handler inserts the order
// and enqueues its event in idem's transaction; "fail-" keys roll back.
type service struct {
	store  *pgstore.Store
	outbox *pgoutbox.Outbox
	schema string
}

func newService(t testing.TB, pool *pgxpool.Pool, schema string, migrate bool) *service {
	t.Helper()
	ctx := context.Background()
	store, err := pgstore.New(pool, &pgstore.Config{Table: schema + ".idem_records"})
	if err != nil {
		t.Fatal(err)
	}
	ob, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".idem_outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if migrate {
		if err := store.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if err := ob.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, "CREATE TABLE "+schema+".orders (key text PRIMARY KEY, by text)"); err != nil {
			t.Fatal(err)
		}
	}
	return &service{store: store, outbox: ob, schema: schema}
}

func (s *service) handler(who string, afterEnqueue func()) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		tx := pgstore.Tx(ctx)
		_, key, _ := idem.KeyFrom(ctx)
		if _, err := tx.Exec(ctx, "INSERT INTO "+s.schema+".orders (key, by) VALUES ($1, $2)", key, who); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		for _, name := range []string{"order.created", "invoice.requested"} {
			if err := s.outbox.Enqueue(ctx, tx, outbox.Message{Name: name, Subject: "orders." + name, Payload: []byte(who + ":" + key)}); err != nil {
				http.Error(w, err.Error(), 500)
				return
			}
		}
		if afterEnqueue != nil {
			afterEnqueue()
		}
		if strings.HasPrefix(key, "fail-") {
			_ = tx.Rollback(ctx)
			http.Error(w, "payment refused", http.StatusPaymentRequired)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, who)
	})
}

func serve(t testing.TB, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return "http://" + ln.Addr().String()
}

func post(url, key string) (int, string, error) {
	req, _ := http.NewRequest("POST", url+"/orders", strings.NewReader(`{"item":"lamp"}`))
	req.Header.Set("Idempotency-Key", key)
	c := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

type row struct {
	id, payload string
}

func outboxRows(t *testing.T, pool *pgxpool.Pool, schema string) []row {
	t.Helper()
	rows, err := pool.Query(context.Background(), "SELECT id, payload FROM "+schema+".idem_outbox ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []row
	for rows.Next() {
		var r row
		var p []byte
		if err := rows.Scan(&r.id, &p); err != nil {
			t.Fatal(err)
		}
		r.payload = string(p)
		out = append(out, r)
	}
	return out
}

var flows = []struct {
	name string
	flow idem.Flow
}{{"ClaimComplete", idem.FlowClaimComplete}, {"SingleTx", idem.FlowSingleTx}}

// TestEnqueueWithTheAnswer: through idem.New + pgstore over loopback HTTP,
// concurrent first sends and retries: each committed order has its two
// events, with the IDs MessageID(scope, key, name); replays enqueue nothing;
// a handler whose transaction rolls back leaves none.
func TestEnqueueWithTheAnswer(t *testing.T) {
	for _, fl := range flows {
		t.Run(fl.name, func(t *testing.T) {
			pool, schema := testDB(t)
			s := newService(t, pool, schema, true)
			mw, err := idem.New(s.store, &idem.Config{Flow: fl.flow})
			if err != nil {
				t.Fatal(err)
			}
			url := serve(t, mw(s.handler("server", nil)))
			const keys, sends = 20, 4
			start := make(chan struct{})
			errs := make(chan error, keys*sends)
			for k := range keys {
				key := fmt.Sprint("order-", k)
				if k%4 == 0 {
					key = "fail-" + key
				}
				for range sends {
					go func() {
						<-start
						for {
							code, _, err := post(url, key)
							if err == nil && code == http.StatusConflict {
								time.Sleep(20 * time.Millisecond) // in flight: retry
								continue
							}
							if err == nil && code != http.StatusCreated && code != http.StatusPaymentRequired {
								err = fmt.Errorf("%s: status %d", key, code)
							}
							errs <- err
							return
						}
					}()
				}
			}
			close(start)
			for range keys * sends {
				if err := <-errs; err != nil {
					t.Fatal(err)
				}
			}
			got := map[string]string{}
			for _, r := range outboxRows(t, pool, schema) {
				if _, dup := got[r.id]; dup {
					t.Fatalf("event %s enqueued twice", r.id)
				}
				got[r.id] = r.payload
			}
			for k := range keys {
				key := fmt.Sprint("order-", k)
				for _, name := range []string{"order.created", "invoice.requested"} {
					if k%4 == 0 {
						if _, ok := got[outbox.MessageID("", "fail-"+key, name)]; ok {
							t.Fatalf("rolled-back fail-%s left event %s", key, name)
						}
						continue
					}
					if got[outbox.MessageID("", key, name)] != "server:"+key {
						t.Fatalf("%s: event %s missing or wrong: %q", key, name, got[outbox.MessageID("", key, name)])
					}
				}
			}
			if want := 2 * (keys - keys/4); len(got) != want {
				t.Fatalf("%d events, want %d", len(got), want)
			}
		})
	}
}

// TestCrashChild is the child of TestTakeoverAfterCrash: it serves the order
// handler, which enqueues and then blocks inside the transaction until the
// parent SIGKILLs the process.
func TestCrashChild(t *testing.T) {
	if os.Getenv(envChild) != "1" {
		t.Skip("the child process of TestTakeoverAfterCrash")
	}
	pool, err := pgxpool.New(context.Background(), testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	s := newService(t, pool, os.Getenv(envSchema), false)
	flow, _ := strconv.Atoi(os.Getenv(envFlow))
	mw, err := idem.New(s.store, &idem.Config{Flow: idem.Flow(flow), Lease: crashLease})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fmt.Println(childLine + "listen " + ln.Addr().String())
	t.Fatal(http.Serve(ln, mw(s.handler("child", func() {
		fmt.Println(childLine + "enqueued")
		select {}
	}))))
}

// TestTakeoverAfterCrash: a server process is SIGKILLed after its handler
// enqueued, inside the transaction; the retry, at a fresh server, takes the
// key over and commits: the outbox holds the committed attempt's events
// only, with the IDs the dead attempt would have used.
func TestTakeoverAfterCrash(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process and waits for a lease to lapse")
	}
	for _, fl := range flows {
		t.Run(fl.name, func(t *testing.T) {
			pool, schema := testDB(t)
			s := newService(t, pool, schema, true)
			key := "crash-" + randHex(6)
			cmd := exec.Command(os.Args[0], "-test.run=^TestCrashChild$", "-test.count=1")
			cmd.Env = append(os.Environ(), envChild+"=1", envSchema+"="+schema, envFlow+"="+strconv.Itoa(int(fl.flow)))
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
					if l, ok := strings.CutPrefix(sc.Text(), childLine); ok {
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
			go func() { _, _, _ = post("http://"+addr, key) }()
			if l := next(); l != "enqueued" {
				t.Fatalf("child said %q", l)
			}
			if err := cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			_ = cmd.Wait()
			mw, err := idem.New(s.store, &idem.Config{Flow: fl.flow, Lease: crashLease})
			if err != nil {
				t.Fatal(err)
			}
			url := serve(t, mw(s.handler("survivor", nil)))
			deadline := time.Now().Add(30 * time.Second)
			for {
				code, body, err := post(url, key)
				if err != nil {
					t.Fatal(err)
				}
				if code == http.StatusCreated {
					if body != "survivor" {
						t.Fatalf("answer %q", body)
					}
					break
				}
				if code != http.StatusConflict || time.Now().After(deadline) {
					t.Fatalf("retry: %d %s", code, body)
				}
				time.Sleep(100 * time.Millisecond)
			}
			rows := outboxRows(t, pool, schema)
			if len(rows) != 2 {
				t.Fatalf("outbox holds %v, want the survivor's 2 events", rows)
			}
			for i, name := range []string{"order.created", "invoice.requested"} {
				if rows[i].id != outbox.MessageID("", key, name) || rows[i].payload != "survivor:"+key {
					t.Fatalf("event %d: %+v", i, rows[i])
				}
			}
		})
	}
}
