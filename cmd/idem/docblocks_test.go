package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The shell blocks of README.md and docs/*.md, pasted into bash as one piece,
// the way a user does: TestDocShellBlocks runs every block that starts a server
// or talks to one, and fails on any command of it that fails (bash -e), on a
// curl that cannot connect, and on an answer the block's comments promise but
// that does not come.
//
// How a block runs:
//   - in a directory of its own that links every entry of the repository's
//     root (so proxy/testdata/orders.py and the like resolve, and the files a
//     block writes, such as keys.db, land in that directory);
//   - with `go run ./cmd/idem` and `idem` running the binary TestMain built, and
//     `go run ./examples/NAME` a binary of that example built for the test (a
//     `go` shim on PATH; any other go command is the real one), so that the
//     block times the servers, not the compiler;
//   - with every loopback port the block names (127.0.0.1:N, localhost:N,
//     --port N), other than the services', replaced by a free one, so that it
//     runs beside other tests and a developer's own servers;
//   - after what the prose around it says runs in another terminal (the demo,
//     the quick start), started by the test;
//   - within a bounded time, after which its whole process group is killed; a
//     process of the block still listening on one of its ports after that (an
//     orphan) is a failure.
//
// A new shell block must be classified in docBlockPlans (what to start first,
// what its output must show), or marked as not runnable with the reason.

// docBlockPlan says how to run one shell block.
type docBlockPlan struct {
	// match is a piece of the block that identifies it.
	match string
	// skip, when set, says why the block is not run.
	skip string
	// demo starts idem demo (SQLite file idem-demo.db in the block's directory)
	// with these flags first, and sets DEMO to its URL.
	demo []string
	// example starts `go run ./examples/NAME` first, on the block's port for
	// the given address.
	example, exampleAddr string
	// needs names a service the block needs ("nats"): skipped with a message
	// when it is unreachable, unless IDEM_REQUIRE_SERVICES=1.
	needs string
	// before, when set, prepares the service as a first-time user finds it.
	before func(t *testing.T)
	// want lists what the block's output must contain, wantCount what it must
	// contain exactly n times.
	want      []string
	wantCount map[string]int
}

var docBlockPlans = []docBlockPlan{
	{match: "go run ./cmd/idem demo          # run the reference orders service", skip: "the two commands, run one at a time: the demo in the foreground until Ctrl-C, then the whole test suite"},
	{match: `for i in 1 2; do   # the 2nd answer is the stored 201, with "Idempotent-Replayed: true"`, demo: []string{},
		want:      []string{"Idempotent-Replayed: true", "idempotency_key_reused", "state:       complete"},
		wantCount: map[string]int{"HTTP/1.1 201 Created": 2, `"cart_id":`: 2 + 1}}, // the two 201s' bodies and the one order listed
	{match: "wait            # → 201 and 409 (or a replayed 201)", demo: []string{"--handler-delay", "1s"},
		want: []string{"201\n"}, wantCount: map[string]int{`{"orders":[{"id":`: 1, `"cart_id":`: 1}},
	{match: "curl -X POST localhost:8080/orders \\", example: "quickstart", exampleAddr: "127.0.0.1:8080",
		want: []string{`{"id":1}`}},
	{match: "python3 proxy/testdata/orders.py --db upstream.db --port 3000 &",
		want: []string{"Idempotent-Replayed: true", `{"count": 1}`, " 0 failed"}},
	{match: "go build -o orders-worker ./examples/orders-worker   # a binary, so that kill stops the worker itself", needs: "nats", before: freshOrdersStream,
		want: []string{"created order ord_", "message o-1: ack (duplicate)", "\n1 orders\n"}},
	{match: `idem resolve --db sqlite:keys.db --scope acme --status 201 \`, skip: "a fragment: settling a key the proxy left in flight needs an upstream that died mid-request"},
	{match: "IDEM_LINEARIZABILITY_OPS=10m go test", skip: "the long test runs, minutes each"},
	{match: "go get github.com/idemkit/idem/pgstore", skip: "the modules are not published yet: scripts/check-modules (CI) builds a program outside the repository that imports them, through replace directives"},
}

// docBlock is one shell block of a page.
type docBlock struct {
	page string // README.md, docs/proxy.md, …
	line int    // the line of its opening fence
	text string
}

// docShellBlocks returns the ```sh blocks of README.md and docs/*.md.
func docShellBlocks(t *testing.T, root string) []docBlock {
	t.Helper()
	pages, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	pages = append([]string{filepath.Join(root, "README.md")}, pages...)
	var blocks []docBlock
	for _, p := range pages {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, p)
		var cur *docBlock
		for i, line := range strings.Split(string(b), "\n") {
			trimmed := strings.TrimSpace(line)
			switch {
			case cur == nil && (trimmed == "```sh" || trimmed == "```bash" || trimmed == "```shell"):
				cur = &docBlock{page: filepath.ToSlash(rel), line: i + 1}
			case cur != nil && trimmed == "```":
				blocks = append(blocks, *cur)
				cur = nil
			case cur != nil:
				cur.text += line + "\n"
			}
		}
	}
	return blocks
}

// planFor returns the plan whose match the block holds.
func planFor(b docBlock) (docBlockPlan, bool) {
	for _, p := range docBlockPlans {
		if strings.Contains(b.text, p.match) {
			return p, true
		}
	}
	return docBlockPlan{}, false
}

func TestDocShellBlocks(t *testing.T) {
	t.Parallel()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	blocks := docShellBlocks(t, root)
	if len(blocks) == 0 {
		t.Fatal("no shell blocks found in README.md and docs/")
	}
	env := newBlockEnv(t, root)
	for _, b := range blocks {
		plan, ok := planFor(b)
		name := fmt.Sprintf("%s:%d", b.page, b.line)
		if !ok {
			t.Errorf("%s: a shell block that no plan in docBlockPlans matches; classify it (first line %q)", name, strings.SplitN(b.text, "\n", 2)[0])
			continue
		}
		if plan.skip != "" {
			continue
		}
		t.Run(strings.NewReplacer("/", "_", ".md", "").Replace(name), func(t *testing.T) {
			t.Parallel()
			env.run(t, b, plan)
		})
	}
}

// blockEnv is what every block run shares: the repository's root, the shim
// directory put first on PATH, and the example binaries built so far.
type blockEnv struct {
	root, bin string
	mu        sync.Mutex
	built     map[string]error // example name → the build's outcome
}

// newBlockEnv writes the go and idem shims.
func newBlockEnv(t *testing.T, root string) *blockEnv {
	t.Helper()
	e := &blockEnv{root: root, bin: t.TempDir(), built: map[string]error{}}
	realGo, err := exec.LookPath("go")
	if err != nil {
		t.Fatal(err)
	}
	// Like go run, the shim runs the program as its child and waits for it:
	// SIGINT and SIGQUIT (a terminal's Ctrl-C and Ctrl-\) reach the child
	// through the process group and the shim outlives them, while SIGTERM
	// (kill %1) ends the shim alone and leaves the child running, an orphan,
	// unless the program stops with its parent.
	shim := `#!/usr/bin/env bash
# go run ./cmd/idem and go run ./examples/NAME run prebuilt binaries, as go run does.
if [ "$1" = run ]; then
  bin=
  case "$2" in
    ./cmd/idem|./cmd/idem/) bin="$IDEM_BLOCK_BIN/idem" ;;
    ./examples/*) name=${2#./examples/}; name=${name%/}; bin="$IDEM_BLOCK_BIN/example-$name" ;;
  esac
  if [ -n "$bin" ]; then
    shift 2
    trap '' INT QUIT
    "$bin" "$@" &
    wait $!
    exit $?
  fi
fi
exec ` + strconv.Quote(realGo) + ` "$@"
`
	if err := os.WriteFile(filepath.Join(e.bin, "go"), []byte(shim), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(idemBin, filepath.Join(e.bin, "idem")); err != nil {
		t.Fatal(err)
	}
	return e
}

// example builds ./examples/name once.
func (e *blockEnv) example(name string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if err, ok := e.built[name]; ok {
		return err
	}
	cmd := exec.Command("go", "build", "-o", filepath.Join(e.bin, "example-"+name), "./examples/"+name)
	cmd.Dir = e.root
	out, err := cmd.CombinedOutput()
	if err != nil {
		err = fmt.Errorf("go build ./examples/%s: %v\n%s", name, err, out)
	}
	e.built[name] = err
	return err
}

// servicePorts are the services' ports, which blocks use as they are.
var servicePorts = map[string]bool{"5432": true, "3306": true, "6379": true, "4222": true, "5672": true}

// blockPortRE finds the loopback ports a block names.
var blockPortRE = regexp.MustCompile(`(127\.0\.0\.1:|localhost:|--port )([0-9]{2,5})\b`)

// freePorts maps each port the text names (other than the services') to a
// free loopback port, and returns the text with them replaced.
func freePorts(t *testing.T, text string) (string, map[string]string) {
	t.Helper()
	ports := map[string]string{}
	// Every listener stays open until all ports are chosen: one closed at once
	// could be handed out again, and two of the block's ports would become one.
	var held []net.Listener
	defer func() {
		for _, ln := range held {
			ln.Close()
		}
	}()
	for _, m := range blockPortRE.FindAllStringSubmatch(text, -1) {
		p := m[2]
		if servicePorts[p] || ports[p] != "" {
			continue
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, ln)
		_, free, _ := net.SplitHostPort(ln.Addr().String())
		ports[p] = free
	}
	out := blockPortRE.ReplaceAllStringFunc(text, func(s string) string {
		m := blockPortRE.FindStringSubmatch(s)
		if q := ports[m[2]]; q != "" {
			return m[1] + q
		}
		return s
	})
	return out, ports
}

// blockDir makes the directory a block runs in: a link to every entry of the
// repository's root.
func (e *blockEnv) blockDir(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	entries, err := os.ReadDir(e.root)
	if err != nil {
		t.Fatal(err)
	}
	for _, ent := range entries {
		if strings.HasSuffix(ent.Name(), ".db") || strings.HasPrefix(ent.Name(), ".git") {
			continue // a developer's own databases stay theirs
		}
		if err := os.Symlink(filepath.Join(e.root, ent.Name()), filepath.Join(dir, ent.Name())); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// blockTimeout bounds one block's run, servers included.
const blockTimeout = 4 * time.Minute

func (e *blockEnv) run(t *testing.T, b docBlock, plan docBlockPlan) {
	if plan.needs == "nats" {
		testenv.NATSURL(t) // skips (or fails under IDEM_REQUIRE_SERVICES=1) when NATS is unreachable
	}
	text, ports := freePorts(t, b.text)
	for _, m := range regexp.MustCompile(`go run \./examples/([a-z0-9-]+)`).FindAllStringSubmatch(text+" go run ./examples/"+plan.example, -1) {
		if err := e.example(m[1]); err != nil {
			t.Fatal(err)
		}
	}
	dir := e.blockDir(t)
	env := cliEnv("PATH="+e.bin+string(os.PathListSeparator)+os.Getenv("PATH"), "IDEM_BLOCK_BIN="+e.bin)
	if plan.before != nil {
		plan.before(t)
	}
	if plan.demo != nil {
		d := startDemo(t, dir, nil, append([]string{"--db", "sqlite:idem-demo.db", "--metrics-addr", ""}, plan.demo...)...)
		env = append(env, "DEMO="+d.URL)
	}
	blockPorts := ports
	if plan.example != "" {
		_, port, _ := net.SplitHostPort(plan.exampleAddr)
		addr := "127.0.0.1:" + ports[port]
		startExample(t, dir, filepath.Join(e.bin, "example-"+plan.example), "-addr", addr)
		blockPorts = map[string]string{} // the example's port is the test's, not the block's
		for p, q := range ports {
			if p != port {
				blockPorts[p] = q
			}
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), blockTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-e", "-o", "pipefail", "-c", text)
	cmd.Dir = dir
	cmd.Env = env
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	cmd.WaitDelay = 10 * time.Second
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	if errors.Is(err, exec.ErrWaitDelay) && cmd.ProcessState != nil && cmd.ProcessState.Success() {
		// bash exited 0, but something it left in the background still holds
		// its output: the check below names it.
		err = nil
	}
	// The block is over: what it started in the background it must have
	// stopped (a server left running keeps its port: the block cannot be
	// pasted twice), and nothing may outlive the go run that started it.
	// Then the rest of its process group goes, as with a closed terminal.
	orphans := lingering(blockPorts)
	if cmd.Process != nil {
		_ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
	}
	report := func(format string, args ...any) {
		t.Helper()
		t.Errorf("%s:%d: "+format+"\n--- the block as run ---\n%s--- its output ---\n%s", append(append([]any{b.page, b.line}, args...), text, out.String())...)
	}
	if ctx.Err() != nil {
		report("did not finish within %v", blockTimeout)
		return
	}
	if err != nil {
		report("a command failed (%v)", err)
		return
	}
	got := out.String()
	if strings.Contains(got, "curl: (") {
		report("curl could not talk to a server the block started")
	}
	for _, w := range plan.want {
		if !strings.Contains(got, w) {
			report("the output lacks %q", w)
		}
	}
	for w, n := range plan.wantCount {
		if c := strings.Count(got, w); c != n {
			report("the output has %q %d times, want %d", w, c, n)
		}
	}
	if len(orphans) > 0 {
		report("after the block ended, something it started still listens on 127.0.0.1:%s: a server the block did not stop, or one that outlived the go run that started it", strings.Join(orphans, ", 127.0.0.1:"))
	}
}

// lingering returns the ports that still accept connections: it waits up to
// a minute for each to close (a server stopping drains first). The demo and
// example the test started itself run until the test's end, so their ports
// are not among ports.
func lingering(ports map[string]string) []string {
	var open []string
	for _, p := range ports {
		open = append(open, p)
	}
	sort.Strings(open)
	deadline := time.Now().Add(time.Minute)
	for len(open) > 0 {
		var still []string
		for _, p := range open {
			if c, err := net.DialTimeout("tcp", "127.0.0.1:"+p, time.Second); err == nil {
				c.Close()
				still = append(still, p)
			}
		}
		open = still
		if len(open) == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	return open
}

// startExample runs an example's binary in dir until the test ends, and waits
// for the line it logs once it accepts connections.
func startExample(t *testing.T, dir, bin string, args ...string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	ready := make(chan bool, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sent := false
		for sc.Scan() { // to the end, so that the example never blocks on its log
			if !sent && strings.Contains(sc.Text(), "listening on ") {
				ready <- true
				sent = true
			}
		}
		if !sent {
			ready <- false
		}
	}()
	select {
	case ok := <-ready:
		if !ok {
			t.Fatalf("%s %v exited before it listened", bin, args)
		}
	case <-time.After(time.Minute):
		t.Fatalf("%s %v did not log that it listens within a minute", bin, args)
	}
}

// freshOrdersStream deletes the ORDERS stream of the consumers' "Try it", so
// that the block finds NATS as a first-time user does (a stream left by an
// earlier run would hold its messages and its consumer's acks).
func freshOrdersStream(t *testing.T) {
	t.Helper()
	nc, err := nats.Connect(testenv.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := js.DeleteStream(ctx, "ORDERS"); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Fatal(err)
	}
}
