package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"
)

// idemBin is the idem binary built once by TestMain; tests that drive the CLI
// as a user would run it.
var idemBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "idem-cli-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	idemBin = filepath.Join(dir, "idem")
	build := exec.Command("go", "build", "-o", idemBin, ".")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintf(os.Stderr, "building the idem binary for the tests: %v\n", err)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// cliEnv is the environment the binary runs with: the test's own, minus the
// variables that mirror flags (so that a developer's IDEM_DB does not leak into a
// test), plus extra ("NAME=value").
func cliEnv(extra ...string) []string {
	mirrored := map[string]bool{}
	for _, e := range append(append([]storeEnvVar{}, demoEnv...), storeCmdEnv...) {
		mirrored[e.env] = true
	}
	var env []string
	for _, kv := range os.Environ() {
		name, _, _ := strings.Cut(kv, "=")
		if !mirrored[name] {
			env = append(env, kv)
		}
	}
	return append(env, extra...)
}

// runIdem runs the binary to completion in dir and returns its exit code and
// output.
func runIdem(t *testing.T, dir string, env []string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, idemBin, args...)
	cmd.Dir = dir
	cmd.Env = cliEnv(env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return ee.ExitCode(), out.String(), errb.String()
		}
		t.Fatalf("idem %s: %v", strings.Join(args, " "), err)
	}
	return 0, out.String(), errb.String()
}

// demoProc is a running `idem demo`.
type demoProc struct {
	URL  string // http://127.0.0.1:PORT
	Port string
	cmd  *exec.Cmd
	mu   sync.Mutex
	out  bytes.Buffer // stdout after the first line
	errb bytes.Buffer
	done chan struct{}
	code int
}

func (d *demoProc) output() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.out.String() + "\n--- stderr ---\n" + d.errb.String()
}

type cliLockedBuf struct {
	mu *sync.Mutex
	b  *bytes.Buffer
}

func (l cliLockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

var listenRE = regexp.MustCompile(`^idem demo: listening on (http://127\.0\.0\.1:(\d+))$`)

// startDemo starts `idem demo --addr 127.0.0.1:0 args…` in dir, reads the
// address from its first line of output, waits until /healthz answers, and stops
// it (SIGINT, then kill) when the test ends.
func startDemo(t *testing.T, dir string, env []string, args ...string) *demoProc {
	t.Helper()
	d := &demoProc{done: make(chan struct{})}
	d.cmd = exec.Command(idemBin, append([]string{"demo", "--addr", "127.0.0.1:0"}, args...)...)
	d.cmd.Dir = dir
	d.cmd.Env = cliEnv(env...)
	d.cmd.Stderr = cliLockedBuf{&d.mu, &d.errb}
	stdout, err := d.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := d.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	first := make(chan string, 1)
	go func() {
		r := bufio.NewReader(stdout)
		line, _ := r.ReadString('\n')
		first <- strings.TrimRight(line, "\n")
		_, _ = io.Copy(cliLockedBuf{&d.mu, &d.out}, r)
	}()
	go func() {
		err := d.cmd.Wait()
		d.code = d.cmd.ProcessState.ExitCode()
		_ = err
		close(d.done)
	}()
	t.Cleanup(func() { d.stop(t) })
	select {
	case line := <-first:
		m := listenRE.FindStringSubmatch(line)
		if m == nil {
			<-d.done
			t.Fatalf("idem demo %v: first line %q is not the address; output:\n%s", args, line, d.output())
		}
		d.URL, d.Port = m[1], m[2]
	case <-time.After(60 * time.Second):
		t.Fatalf("idem demo %v printed no address in 60s; output:\n%s", args, d.output())
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(d.URL + "/healthz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 && strings.Contains(d.output(), "Press Ctrl-C to stop.") {
				return d // serving, and the whole banner has been read
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("idem demo at %s: /healthz did not answer 200 in 30s (%v); output:\n%s", d.URL, err, d.output())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// stop sends SIGINT and waits for a clean exit; it kills the process after 40 s.
// It returns the exit code.
func (d *demoProc) stop(t *testing.T) int {
	t.Helper()
	select {
	case <-d.done:
		return d.code
	default:
	}
	_ = d.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-d.done:
	case <-time.After(40 * time.Second):
		_ = d.cmd.Process.Kill()
		<-d.done
		t.Errorf("idem demo did not stop within 40s of SIGINT; output:\n%s", d.output())
	}
	return d.code
}

func cliRandHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// newPostgresDatabase creates a database of its own on the test PostgreSQL
// server, drops it when the test ends, and returns its URL.
func newPostgresDatabase(t *testing.T) string {
	t.Helper()
	base := testenv.PostgresURL(t)
	admin := pgConnect(t, base)
	name := "idem_demo_" + cliRandHex(6)
	if _, err := admin.Exec(context.Background(), "CREATE DATABASE "+name); err != nil {
		t.Fatalf("CREATE DATABASE %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		conn, err := pgx.Connect(ctx, base)
		if err != nil {
			t.Errorf("drop database %s: %v", name, err)
			return
		}
		defer conn.Close(ctx)
		if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+name+" WITH (FORCE)"); err != nil {
			t.Errorf("DROP DATABASE %s: %v", name, err)
		}
	})
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	return u.String()
}

// pgConnect opens one connection, closed when the test ends.
func pgConnect(t *testing.T, raw string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, raw)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// newMySQLDatabase creates a database of its own on the test MySQL server,
// drops it when the test ends, and returns its mysql:// URL and a handle on it.
func newMySQLDatabase(t *testing.T) (string, *sql.DB) {
	t.Helper()
	base := testenv.MySQLURL(t)
	admin, err := sql.Open("mysql", testenv.MySQLDSN(base))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close()
	name := "idem_demo_" + cliRandHex(6)
	if _, err := admin.Exec("CREATE DATABASE " + name); err != nil {
		t.Fatalf("CREATE DATABASE %s: %v", name, err)
	}
	u, err := url.Parse(base)
	if err != nil {
		t.Fatal(err)
	}
	u.Path = "/" + name
	db, err := sql.Open("mysql", testenv.MySQLDSN(u.String()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, err := db.Exec("DROP DATABASE IF EXISTS " + name)
		if err != nil {
			t.Errorf("DROP DATABASE %s: %v", name, err)
		}
		_ = db.Close()
	})
	return u.String(), db
}

// deleteRedisPrefix deletes every Redis key under prefix.
func deleteRedisPrefix(t *testing.T, raw, prefix string) {
	t.Helper()
	opts, err := redis.ParseURL(raw)
	if err != nil {
		t.Error(err)
		return
	}
	c := redis.NewClient(opts)
	defer c.Close()
	ctx := context.Background()
	iter := c.Scan(ctx, 0, prefix+"*", 100).Iterator()
	for iter.Next(ctx) {
		c.Del(ctx, iter.Val())
	}
	if err := iter.Err(); err != nil {
		t.Error(err)
	}
}
