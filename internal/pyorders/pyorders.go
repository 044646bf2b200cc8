// Package pyorders runs the Python orders app of proxy/testdata/orders.py, the
// upstream that the proxy's tests (package proxy and `idem proxy`) put idem in
// front of: a process of its own, in another language, with its own SQLite
// database, so that it can be killed mid-request.
package pyorders

import (
	"bufio"
	"encoding/json"
	"net/http"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
)

// App is a running orders app.
type App struct {
	URL  string // "http://127.0.0.1:PORT"
	Port string
	Cmd  *exec.Cmd
}

var listening = regexp.MustCompile(`^listening on (http://127\.0\.0\.1:(\d+))$`)

// Start runs the app with its orders in the SQLite file dbPath (a file in a
// new temporary directory when dbPath is "") and the app's own flags args
// ("--delay-ms", "--port", …), and kills it when the test ends. It fails the
// test when python3 is missing or the app does not say where it listens.
func Start(t testing.TB, dbPath string, args ...string) *App {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatalf("python3 is needed for the upstream app (proxy/testdata/orders.py): %v", err)
	}
	if dbPath == "" {
		dbPath = filepath.Join(t.TempDir(), "orders.db")
	}
	_, here, _, _ := runtime.Caller(0)
	script := filepath.Join(filepath.Dir(here), "..", "..", "proxy", "testdata", "orders.py")
	cmd := exec.Command(py, append([]string{script, "--db", dbPath}, args...)...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("the upstream app did not start: %v", err)
	}
	m := listening.FindStringSubmatch(strings.TrimSpace(line))
	if m == nil {
		t.Fatalf("the upstream app printed %q", line)
	}
	return &App{URL: m[1], Port: m[2], Cmd: cmd}
}

// Executions is the number of orders the app committed, read from its
// database.
func (a *App) Executions(t testing.TB) int {
	t.Helper()
	resp, err := http.Get(a.URL + "/executions")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var doc struct{ Count int }
	if err := json.NewDecoder(resp.Body).Decode(&doc); err != nil {
		t.Fatal(err)
	}
	return doc.Count
}
