package idemgrpc_test

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// crashEnv holds the crash child's crashDB as JSON; set only in the child.
const (
	crashEnv    = "IDEMGRPC_CRASH_CHILD"
	childPrefix = "IDEMGRPC_CHILD "
	crashLease  = 2 * time.Second
)

func TestMain(m *testing.M) {
	if spec := os.Getenv(crashEnv); spec != "" {
		crashChild(spec) // never returns
	}
	os.Exit(m.Run())
}

// crashDB says where a crash test keeps its records and orders.
type crashDB struct {
	Kind   string    // "sqlite" or "postgres"
	DSN    string    // the SQLite file or the PostgreSQL URL
	Schema string    // PostgreSQL: the test's own schema
	Flow   idem.Flow // the idem flow
}

// backend is an open crashDB.
type backend struct {
	store  idem.Store
	insert func(ctx context.Context, cart, who string) error // in the call's transaction
	count  func(ctx context.Context, cart, who string) (int, error)
	close  func()
}

func (d crashDB) open(ctx context.Context) (*backend, error) {
	switch d.Kind {
	case "sqlite":
		db, err := embedded.Open(d.DSN)
		if err != nil {
			return nil, err
		}
		if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (cart TEXT NOT NULL, who TEXT NOT NULL)`); err != nil {
			return nil, err
		}
		store, err := sqlitestore.New(db, nil)
		if err == nil {
			err = store.Migrate(ctx)
		}
		if err != nil {
			return nil, err
		}
		return &backend{
			store: store,
			insert: func(ctx context.Context, cart, who string) error {
				tx := sqlitestore.Tx(ctx)
				if tx == nil {
					return errors.New("no sqlitestore transaction in the handler's context")
				}
				_, err := tx.ExecContext(ctx, `INSERT INTO orders (cart, who) VALUES (?, ?)`, cart, who)
				return err
			},
			count: func(ctx context.Context, cart, who string) (n int, err error) {
				err = db.QueryRowContext(ctx, `SELECT count(*) FROM orders WHERE cart = ? AND (? = '' OR who = ?)`, cart, who, who).Scan(&n)
				return n, err
			},
			close: func() { _ = db.Close() },
		}, nil
	case "postgres":
		pool, err := pgxpool.New(ctx, d.DSN)
		if err != nil {
			return nil, err
		}
		orders := pgx.Identifier{d.Schema, "orders"}.Sanitize()
		if _, err := pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+orders+` (cart TEXT NOT NULL, who TEXT NOT NULL)`); err != nil {
			pool.Close()
			return nil, err
		}
		store, err := pgstore.New(pool, &pgstore.Config{Table: d.Schema + ".idem_records"})
		if err == nil {
			err = store.Migrate(ctx)
		}
		if err != nil {
			pool.Close()
			return nil, err
		}
		return &backend{
			store: store,
			insert: func(ctx context.Context, cart, who string) error {
				tx := pgstore.Tx(ctx)
				if tx == nil {
					return errors.New("no pgstore transaction in the handler's context")
				}
				_, err := tx.Exec(ctx, `INSERT INTO `+orders+` (cart, who) VALUES ($1, $2)`, cart, who)
				return err
			},
			count: func(ctx context.Context, cart, who string) (n int, err error) {
				err = pool.QueryRow(ctx, `SELECT count(*) FROM `+orders+` WHERE cart = $1 AND ($2 = '' OR who = $2)`, cart, who).Scan(&n)
				return n, err
			},
			close: pool.Close,
		}, nil
	}
	return nil, fmt.Errorf("unknown kind %q", d.Kind)
}

// createInTx is the Create handler: it inserts the order in the call's
// transaction, then runs then (if not nil), and answers who did it.
func (b *backend) createInTx(who string, then func()) handlerFunc {
	return func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		cart := in.GetFields()["cart"].GetStringValue()
		if err := b.insert(ctx, cart, who); err != nil {
			return nil, status.Errorf(codes.Internal, "insert: %v", err)
		}
		if then != nil {
			then()
		}
		return structpb.NewStruct(map[string]any{"cart": cart, "who": who})
	}
}

func (b *backend) server(flow idem.Flow) (*idemgrpc.Server, error) {
	return idemgrpc.NewServer(b.store, &idemgrpc.Config{Idem: &idem.Config{Lease: crashLease, Flow: flow}})
}

// crashChild serves Create on a loopback port; its handler inserts the order,
// says so on stdout and blocks, inside the transaction, until SIGKILL.
func crashChild(spec string) {
	fail := func(err error) {
		fmt.Fprintln(os.Stderr, "crash child:", err)
		os.Exit(3)
	}
	var d crashDB
	if err := json.Unmarshal([]byte(spec), &d); err != nil {
		fail(err)
	}
	b, err := d.open(context.Background())
	if err != nil {
		fail(err)
	}
	s, err := b.server(d.Flow)
	if err != nil {
		fail(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fail(err)
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(tenantAuth, s.UnaryInterceptor()))
	gs.RegisterService(&ordersDesc, &ordersService{create: b.createInTx("child", func() {
		fmt.Println(childPrefix + "inserted")
		select {} // inside the transaction until SIGKILL
	})})
	fmt.Println(childPrefix + "listen " + ln.Addr().String())
	fail(gs.Serve(ln))
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func TestCrashSQLite(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process and waits for a lease to lapse")
	}
	t.Parallel()
	testCrash(t, crashDB{Kind: "sqlite", DSN: filepath.Join(t.TempDir(), "crash.db"), Flow: idem.FlowClaimComplete})
}

func TestCrashPostgres(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a child process and waits for a lease to lapse")
	}
	t.Parallel()
	url := testenv.PostgresURL(t)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	schema := "idemgrpc_" + randomHex(6)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		if testenv.Required() {
			t.Fatal(err)
		}
		t.Skipf("PostgreSQL at %s: %v", url, err)
	}
	t.Cleanup(func() {
		p, err := pgxpool.New(context.Background(), url)
		if err == nil {
			_, _ = p.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
			p.Close()
		}
	})
	for _, fl := range []struct {
		name string
		flow idem.Flow
	}{{"claim-complete", idem.FlowClaimComplete}, {"single-tx", idem.FlowSingleTx}} {
		t.Run(fl.name, func(t *testing.T) {
			testCrash(t, crashDB{Kind: "postgres", DSN: url, Schema: schema, Flow: fl.flow})
		})
	}
}

// testCrash kills a server process with SIGKILL while its Create handler is
// inside the transaction, then retries the call with the same key at a fresh
// server on the same database: the dead process's order is gone, the retry runs
// once (after the lease lapses with claim-then-complete), a later retry is a
// replay, and exactly one order exists.
func testCrash(t *testing.T, d crashDB) {
	ctx := context.Background()
	b, err := d.open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.close()
	spec, _ := json.Marshal(d)
	child := exec.Command(os.Args[0], "-test.run=^$")
	child.Env = append(os.Environ(), crashEnv+"="+string(spec))
	child.Stderr = os.Stderr
	out, err := child.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := child.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = child.Process.Kill(); _ = child.Wait() })
	lines := make(chan string, 4)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if l, ok := strings.CutPrefix(sc.Text(), childPrefix); ok {
				lines <- l
			}
		}
		close(lines)
	}()
	next := func(what string) string {
		t.Helper()
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatalf("the child exited before %s", what)
			}
			return l
		case <-time.After(60 * time.Second):
			t.Fatalf("the child did not report %s within 60 s", what)
		}
		return ""
	}
	addr, ok := strings.CutPrefix(next("its address"), "listen ")
	if !ok {
		t.Fatal("the child did not report its address first")
	}
	key, cart := "crash-"+randomHex(8), "cart-"+randomHex(8)
	in := mustStruct(t, map[string]any{"cart": cart})
	dead := make(chan outcome, 1)
	go func() { dead <- invoke(ctx, dial(t, addr), createMethod, key, "t1", in) }()
	if l := next("the insert"); l != "inserted" {
		t.Fatalf("the child said %q, want inserted", l)
	}
	if err := child.Process.Kill(); err != nil { // SIGKILL, inside the transaction
		t.Fatal(err)
	}
	_ = child.Wait()
	killed := time.Now()
	if o := <-dead; o.err == nil {
		t.Fatalf("the call to the killed server got %v, want an error", o.resp)
	}

	// The restarted server, on the same database.
	s, err := b.server(d.Flow)
	if err != nil {
		t.Fatal(err)
	}
	cc := dial(t, serve(t, s, &ordersService{create: b.createInTx("restarted", nil)}))
	aborted := 0
	var got outcome
	for {
		got = invoke(ctx, cc, createMethod, key, "t1", in)
		if status.Code(got.err) != codes.Aborted {
			break
		}
		if _, ok := idemgrpc.RetryDelay(got.err); !ok {
			t.Fatalf("Aborted without RetryInfo: %v", got.err)
		}
		aborted++
		if time.Since(killed) > 30*time.Second {
			t.Fatalf("the retry still gets Aborted %v after the kill", time.Since(killed))
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("the retry ran %v after the kill, after %d Aborted answers", time.Since(killed).Round(time.Millisecond), aborted)
	if got.err != nil || got.replayed || got.resp.GetFields()["who"].GetStringValue() != "restarted" {
		t.Fatalf("retry = %v (replayed %v, %v); want the restarted server's fresh answer", got.resp, got.replayed, got.err)
	}
	if d.Flow == idem.FlowClaimComplete && aborted == 0 {
		t.Error("the retry ran at once; want Aborted while the dead holder's lease is live")
	}
	again := invoke(ctx, cc, createMethod, key, "t1", in)
	if again.err != nil || !again.replayed || again.resp.GetFields()["who"].GetStringValue() != "restarted" {
		t.Fatalf("second retry = %v (replayed %v, %v); want the replay", again.resp, again.replayed, again.err)
	}
	for who, want := range map[string]int{"": 1, "child": 0} {
		n, err := b.count(ctx, cart, who)
		if err != nil || n != want {
			t.Fatalf("orders for the cart (who %q) = %d, %v; want %d", who, n, err, want)
		}
	}
}
