package main

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/jackc/pgx/v5"
)

// TestCLIUsageErrors: wrong input exits 2, prints nothing on stdout, and says
// on stderr what is wrong and what to do; it touches no file.
func TestCLIUsageErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		env  []string
		want []string // in stderr
	}{
		{nil, nil, []string{"idem: no command given", "idem help"}},
		{[]string{"help", "nosuch"}, nil, []string{`idem help: unknown command "nosuch"`, "the commands are bench, check, completion, demo, gc, inspect, migrate"}},
		{[]string{"help", "check", "extra"}, nil, []string{"idem help: give one command", "idem help check"}},
		{[]string{"chek"}, nil, []string{`unknown command "chek" (did you mean "check"?)`}},
		{[]string{"--db", "sqlite:x.db"}, nil, []string{"flags go after the command"}},
		{[]string{"check", "http://127.0.0.1:1/orders", "--concurrency", "0"}, nil, []string{"idem check: --concurrency 0: a race needs at least 2", "the default is 50"}},
		{[]string{"check", "http://127.0.0.1:1/orders", "--rounds", "0"}, nil, []string{"--rounds 0: run at least 1 round"}},
		{[]string{"check", "http://127.0.0.1:1/orders", "--timeout", "0s"}, nil, []string{"--timeout 0s: give a positive per-request timeout"}},
		{[]string{"check", "http://127.0.0.1:1/orders", "--body", ""}, nil, []string{"--body is empty"}},
		{[]string{"check", "http://127.0.0.1:1/orders", "--concurency", "3"}, nil, []string{"unknown flag --concurency (did you mean --concurrency?)"}},
		{[]string{"check", "http://127.0.0.1:1/orders", "--header", "nocolon"}, nil, []string{`invalid value "nocolon" for --header: "nocolon" is not a header; write "Name: value"`}},
		{[]string{"check", "http://127.0.0.1:1/orders", "--timeout"}, nil, []string{"--timeout needs a value"}},
		{[]string{"bench", "--mysql", "nope"}, nil, []string{`--mysql "nope" is not a MySQL URL; use mysql://USER[:PASS]@HOST:PORT/DB`}},
		{[]string{"bench", "--mysql", "postgres://u@h/db"}, nil, []string{"is not a MySQL URL"}},
		{[]string{"bench", "--postgres", "mysql://u@h/db"}, nil, []string{"is not a PostgreSQL URL"}},
		{[]string{"bench", "--redis", "http://127.0.0.1:6379"}, nil, []string{"--redis \"http://127.0.0.1:6379\" is not a Redis URL; use redis://HOST:PORT/DB"}},
		{[]string{"bench"}, []string{"IDEM_TEST_REDIS_URL=127.0.0.1:6379"}, []string{"--redis \"127.0.0.1:6379\" is not a Redis URL"}},
		{[]string{"bench", "--duration", "fast"}, nil, []string{`invalid value "fast" for --duration; use a duration such as 500ms`}},
		{[]string{"gc", "--db", "sqlite:x.db", "--batch", "many"}, nil, []string{`invalid value "many" for --batch; use a whole number`}},
		{[]string{"gc", "--db", "sqlite:x.db", "--prefix", "Bad-"}, nil, []string{`--prefix "Bad-" is not usable`}},
		{[]string{"migrate", "--db", "sqlite:x.db", "--schema", "shop"}, nil, []string{"--schema works on PostgreSQL only"}},
		{[]string{"migrate", "--db", "sqlite:x.db"}, []string{"IDEM_PREFIX=Bad"}, []string{`--prefix "Bad" is not usable`}},
	} {
		dir := t.TempDir()
		code, stdout, stderr := runIdem(t, dir, c.env, c.args...)
		if code != exitUsage || stdout != "" {
			t.Errorf("idem %q: exit %d, stdout %q; want %d and nothing on stdout (stderr %q)", c.args, code, stdout, exitUsage, stderr)
		}
		if !strings.HasPrefix(stderr, "idem") {
			t.Errorf("idem %q: stderr does not start with the command's name: %q", c.args, stderr)
		}
		for _, w := range c.want {
			if !strings.Contains(stderr, w) {
				t.Errorf("idem %q: stderr lacks %q:\n%s", c.args, w, stderr)
			}
		}
		if files, _ := os.ReadDir(dir); len(files) > 0 {
			t.Errorf("idem %q: a usage error left %s in the working directory", c.args, files[0].Name())
		}
	}
}

// TestCLIHelp: help is on stdout and exits 0, in every form.
func TestCLIHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"help"}, {"--help"}, {"-h"}} {
		code, stdout, stderr := runIdem(t, t.TempDir(), nil, args...)
		if code != exitOK || stderr != "" || !strings.Contains(stdout, "Commands:") || !strings.Contains(stdout, "  migrate ") {
			t.Errorf("idem %q: exit %d, stderr %q, stdout:\n%s", args, code, stderr, stdout)
		}
	}
	code, stdout, _ := runIdem(t, t.TempDir(), nil, "help", "gc")
	if code != exitOK || !strings.HasPrefix(stdout, "Usage: idem gc") {
		t.Errorf("idem help gc: exit %d:\n%s", code, stdout)
	}
}

// helpCommands returns the commands `idem help` lists.
func helpCommands(t *testing.T) []string {
	t.Helper()
	_, stdout, _ := runIdem(t, t.TempDir(), nil, "help")
	var names []string
	for _, m := range regexp.MustCompile(`(?m)^  ([a-z]+) `).FindAllStringSubmatch(stdout, -1) {
		names = append(names, m[1])
	}
	if len(names) < 6 {
		t.Fatalf("idem help lists %v:\n%s", names, stdout)
	}
	return names
}

// TestCLIFlagStyle: every command's --help prints its flags as --name, never
// -name, the way the messages and the README write them, and so do its
// messages about an unknown flag.
func TestCLIFlagStyle(t *testing.T) {
	t.Parallel()
	single := regexp.MustCompile(`(?m)^\s+-[a-z]`)
	double := regexp.MustCompile(`(?m)^  --[a-z]`)
	for _, name := range helpCommands(t) {
		code, stdout, stderr := runIdem(t, t.TempDir(), nil, name, "--help")
		if code != exitOK || stderr != "" {
			t.Errorf("idem %s --help: exit %d, stderr %q", name, code, stderr)
		}
		if m := single.FindString(stdout); m != "" || strings.Contains(stdout, "\nFlags:\n") && !double.MatchString(stdout) {
			t.Errorf("idem %s --help: flags not printed as --name (found %q):\n%s", name, m, stdout)
		}
		code, stdout, stderr = runIdem(t, t.TempDir(), nil, name, "--no-such-flag")
		if code != exitUsage || stdout != "" || !strings.HasPrefix(stderr, "idem "+name+": unknown flag --no-such-flag\n") {
			t.Errorf("idem %s --no-such-flag: exit %d, stdout %q, stderr %q; want 2 and \"unknown flag --no-such-flag\"", name, code, stdout, stderr)
		}
	}
}

// closedPort returns a loopback address nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestStoreCommandFailures: the run failures of the store commands exit 1 with
// one clear message: no go-redis log lines before it, no empty SQLite file
// created by a command that only cleans up, the advice to migrate given once.
func TestStoreCommandFailures(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	db := filepath.Join(dir, "app.db")
	if code, out, stderr := runIdem(t, dir, nil, "migrate", "--db", "sqlite:"+db); code != exitOK {
		t.Fatalf("migrate: exit %d\n%s%s", code, out, stderr)
	}

	redisURL := "redis://" + closedPort(t) + "/0"
	code, _, stderr := runIdem(t, dir, nil, "gc", "--db", "sqlite:"+db, "--keys", redisURL)
	lines := strings.Split(strings.TrimRight(stderr, "\n"), "\n")
	if code != exitFailure || len(lines) != 1 || !strings.HasPrefix(lines[0], "idem gc: --keys "+redisURL+": Redis does not answer") {
		t.Errorf("unreachable Redis: exit %d, want 1 and one line of stderr:\n%s", code, stderr)
	}

	code, _, stderr = runIdem(t, dir, nil, "gc", "--db", "sqlite:missing.db")
	if code != exitFailure || !strings.Contains(stderr, "the file missing.db does not exist") || !strings.Contains(stderr, "idem migrate --db sqlite:missing.db") {
		t.Errorf("missing SQLite file: exit %d, stderr %q", code, stderr)
	}
	if _, err := os.Stat(filepath.Join(dir, "missing.db")); !os.IsNotExist(err) {
		t.Errorf("gc created the SQLite file it was pointed at (stat: %v)", err)
	}

	code, _, stderr = runIdem(t, dir, nil, "gc", "--db", "sqlite:"+db, "--table", "nosuch")
	if code != exitFailure || strings.Count(stderr, "idem migrate") != 1 {
		t.Errorf("missing table: exit %d; want 1 and the advice to migrate once:\n%s", code, stderr)
	}
}

// pgTables lists schema.table of the tables in a PostgreSQL database.
func pgTables(t *testing.T, dbURL string) []string {
	t.Helper()
	rows, err := pgConnect(t, dbURL).Query(context.Background(), "SELECT table_schema || '.' || table_name FROM information_schema.tables WHERE table_schema NOT IN ('pg_catalog', 'information_schema') ORDER BY 1")
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// TestMigrateAsDemo: `idem migrate --with-demo-orders` with the demo's --prefix
// and --schema creates exactly the tables `idem demo` with the same flags
// creates, and the demo then serves on them.
func TestMigrateAsDemo(t *testing.T) {
	t.Parallel()
	t.Run("postgres", func(t *testing.T) {
		t.Parallel()
		migrated, demoed := newPostgresDatabase(t), newPostgresDatabase(t)
		code, out, stderr := runIdem(t, t.TempDir(), []string{"IDEM_SCHEMA=shop"}, "migrate", "--db", migrated, "--prefix", "p_", "--with-demo-orders")
		if code != exitOK || !strings.Contains(out, "table shop.p_orders") {
			t.Fatalf("migrate: exit %d\n%s%s", code, out, stderr)
		}
		d := startDemo(t, t.TempDir(), nil, "--db", demoed, "--schema", "shop", "--prefix", "p_")
		d.stop(t)
		got, want := pgTables(t, migrated), pgTables(t, demoed)
		if !slices.Equal(got, want) || !slices.Equal(got, []string{"shop.p_idem_records", "shop.p_idem_records_steps", "shop.p_orders"}) {
			t.Fatalf("migrate created %v, the demo %v", got, want)
		}
		d = startDemo(t, t.TempDir(), nil, "--db", migrated, "--schema", "shop", "--prefix", "p_")
		if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "migrated-1", `{"cart_id":"c_mig","total_cents":1}`); a.Status != 201 {
			t.Fatalf("POST to the demo on the migrated tables: %d %s", a.Status, a.Body)
		}
		if got := pgTables(t, migrated); !slices.Equal(got, want) {
			t.Fatalf("the demo on the migrated database made %v", got)
		}
	})
	t.Run("sqlite", func(t *testing.T) {
		t.Parallel()
		dir := t.TempDir()
		migrated, demoed := filepath.Join(dir, "m.db"), filepath.Join(dir, "d.db")
		if code, out, stderr := runIdem(t, dir, nil, "migrate", "--db", "sqlite:"+migrated, "--prefix", "demo_", "--with-demo-orders"); code != exitOK {
			t.Fatalf("migrate: exit %d\n%s%s", code, out, stderr)
		}
		d := startDemo(t, dir, nil, "--db", "sqlite:"+demoed, "--prefix", "demo_")
		d.stop(t)
		got, want := sqliteTables(t, migrated), sqliteTables(t, demoed)
		if !slices.Equal(got, want) || !slices.Contains(got, "demo_orders") || !slices.Contains(got, "demo_idem_records") {
			t.Fatalf("migrate created %v, the demo %v", got, want)
		}
		// gc finds the prefixed table.
		code, out, stderr := runIdem(t, dir, nil, "gc", "--db", "sqlite:"+migrated, "--prefix", "demo_")
		if code != exitOK || !strings.Contains(out, "table demo_idem_records") {
			t.Fatalf("gc --prefix: exit %d\n%s%s", code, out, stderr)
		}
	})
}

// mysqlDSNOf writes a mysql:// URL in go-sql-driver's DSN form.
func mysqlDSNOf(myURL string) string {
	dsn := strings.TrimPrefix(myURL, "mysql://")
	at := strings.LastIndex(dsn, "@")
	slash := strings.Index(dsn[at:], "/") + at
	return dsn[:at] + "@tcp(" + dsn[at+1:slash] + ")" + dsn[slash:]
}

// TestBenchMySQLURL: bench --mysql takes the mysql:// URL idem demo --db takes,
// and the go-sql-driver DSN form.
func TestBenchMySQLURL(t *testing.T) {
	t.Parallel()
	myURL := testenv.MySQLURL(t)
	for _, value := range []string{myURL, mysqlDSNOf(myURL)} {
		dir := t.TempDir()
		code, out, stderr := runIdem(t, dir, nil, "bench", "--stores", "mysql", "--mysql", value, "--fiber=false", "--isolate=false",
			"--duration", "20ms", "--rounds", "1", "--concurrency", "1", "--replay-keys", "2", "--out", dir)
		if code != exitOK || !strings.Contains(out, "| mysql | first | 1 |") {
			t.Errorf("--mysql %s: exit %d\n%s\n%s", value, code, out, stderr)
		}
	}
}

// TestMySQLDSNFormEverywhere: every store command takes the go-sql-driver DSN
// form the Go examples take (root@tcp(127.0.0.1:3306)/test, bare or after
// mysql://) as well as the mysql:// URL; --db refused it with exit 2.
func TestMySQLDSNFormEverywhere(t *testing.T) {
	t.Parallel()
	myURL, db := newMySQLDatabase(t)
	dsn := mysqlDSNOf(myURL)
	dir := t.TempDir()
	for _, args := range [][]string{
		{"migrate", "--db", dsn, "--with-demo-orders"},
		{"migrate", "--db", "mysql://" + dsn},
		{"gc", "--db", dsn},
		{"inspect", "--db", dsn, "--summary"},
	} {
		if code, out, stderr := runIdem(t, dir, nil, args...); code != exitOK {
			t.Errorf("idem %q: exit %d\n%s%s", args, code, out, stderr)
		}
	}
	d := startDemo(t, dir, nil, "--db", dsn)
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "dsn-"+cliRandHex(4), `{"cart_id":"c_dsn","total_cents":1}`); a.Status != 201 {
		t.Fatalf("POST to the demo on --db %s: %d %s", dsn, a.Status, a.Body)
	}
	var n int
	if err := db.QueryRow("SELECT count(*) FROM orders WHERE cart_id = 'c_dsn'").Scan(&n); err != nil || n != 1 {
		t.Fatalf("orders in the DSN's database: %d, %v", n, err)
	}
}

func TestListenAddrProblem(t *testing.T) {
	t.Parallel()
	for addr, want := range map[string]string{
		"127.0.0.1:8080": "", ":0": "", "localhost:3000": "", "[::1]:9": "",
		"notaport":         `--addr "notaport" is not HOST:PORT`,
		"127.0.0.1:http2":  `port "http2" is not a number`,
		"127.0.0.1:70000":  `port "70000" is not a number from 0 to 65535`,
		"127.0.0.1:8080:1": "is not HOST:PORT",
	} {
		got := listenAddrProblem("--addr", addr)
		if want == "" && got != "" || want != "" && !strings.Contains(got, want) {
			t.Errorf("listenAddrProblem(%q) = %q, want %q", addr, got, want)
		}
	}
}

// TestCompletionBash: the script `idem completion bash` prints completes
// commands, help topics and each command's flags in a real bash.
func TestCompletionBash(t *testing.T) {
	t.Parallel()
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Fatalf("bash is needed to test the completion script: %v", err)
	}
	code, script, stderr := runIdem(t, t.TempDir(), nil, "completion", "bash")
	if code != exitOK {
		t.Fatalf("idem completion bash: exit %d %s", code, stderr)
	}
	probe := script + `
c() { COMP_WORDS=("$@"); COMP_CWORD=$(($#-1)); _idem; echo "${COMPREPLY[*]}"; }
c "$IDEM" ch
c "$IDEM" help mi
c "$IDEM" migrate --pre
c "$IDEM" check http://127.0.0.1/ --conc
c "$IDEM" gc --
`
	cmd := exec.Command(bash, "--norc", "-c", probe)
	cmd.Env = append(os.Environ(), "IDEM="+idemBin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("bash: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimRight(string(out), "\n"), "\n")
	want := []string{"check", "migrate", "--prefix", "--concurrency"}
	if len(lines) != 5 || !slices.Equal(lines[:4], want) {
		t.Fatalf("completions %q, want %q and gc's flags", lines, want)
	}
	for _, f := range []string{"--db", "--batch", "--prefix", "--schema", "--keys", "--table"} {
		if !slices.Contains(strings.Fields(lines[4]), f) {
			t.Errorf("idem gc -- completes to %q, without %s", lines[4], f)
		}
	}
	if code, _, stderr := runIdem(t, t.TempDir(), nil, "completion", "fish"); code != exitUsage || !strings.Contains(stderr, "idem completion bash") {
		t.Errorf("idem completion fish: exit %d %q", code, stderr)
	}
}
