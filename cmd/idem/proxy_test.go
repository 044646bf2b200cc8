package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pyorders"
)

var (
	proxyListenRE = regexp.MustCompile(`^idem proxy: listening on (http://127\.0\.0\.1:\d+),`)
	proxyAdminRE  = regexp.MustCompile(`^idem proxy: GET /healthz and GET /metrics on (http://127\.0\.0\.1:\d+)`)
)

// proxyProc is a running `idem proxy`.
type proxyProc struct {
	URL, Admin string // Admin is "" without --admin-addr
	Banner     string // the lines up to the routes and scope
	Cmd        *exec.Cmd
	stderr     *syncBuffer
	stdout     *bufio.Reader
}

// startProxyProc runs `idem proxy --listen 127.0.0.1:0 args…` and reads its
// banner.
func startProxyProc(t *testing.T, args ...string) *proxyProc {
	t.Helper()
	return startProxyProcEnv(t, nil, args...)
}

// startProxyProcEnv is startProxyProc with more environment variables.
func startProxyProcEnv(t *testing.T, env []string, args ...string) *proxyProc {
	t.Helper()
	cmd := exec.Command(idemBin, append([]string{"proxy", "--listen", "127.0.0.1:0"}, args...)...)
	cmd.Env = cliEnv(env...)
	errb := &syncBuffer{}
	cmd.Stderr = errb
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Signal(syscall.SIGINT); _ = cmd.Wait() })
	r := bufio.NewReader(out)
	pp := &proxyProc{Cmd: cmd, stderr: errb, stdout: r}
	for {
		line, err := r.ReadString('\n')
		pp.Banner += line
		if m := proxyListenRE.FindStringSubmatch(line); m != nil {
			pp.URL = m[1]
		}
		if m := proxyAdminRE.FindStringSubmatch(line); m != nil {
			pp.Admin = m[1]
		}
		if strings.HasPrefix(line, "idem proxy: keyed routes:") && pp.URL != "" {
			return pp
		}
		if err != nil {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("idem proxy printed %q; stderr:\n%s", pp.Banner, errb.String())
		}
	}
}

// syncBuffer is a strings.Builder safe for a process's writes and a test's
// reads.
type syncBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

type proxyAnswer struct {
	status int
	header http.Header
	body   string
	code   string
}

func proxyPost(t *testing.T, url, key, body string) proxyAnswer {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Idempotency-Key", key)
	req.Header.Set("X-Tenant-ID", "t1")
	req.Header.Set("Content-Type", "application/json")
	resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: time.Minute}).Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	var p struct{ Code string }
	_ = json.Unmarshal(b, &p)
	return proxyAnswer{resp.StatusCode, resp.Header, string(b), p.Code}
}

func TestProxyUnknownOutcomeThenResolve(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ordersDB := filepath.Join(dir, "orders.db")
	app := pyorders.Start(t, ordersDB)
	keysDB := "sqlite:" + filepath.Join(dir, "keys.db")
	pp := startProxyProc(t, "--upstream", app.URL, "--db", keysDB, "--route", "POST /orders",
		"--scope-header", "X-Tenant-ID", "--lease", "3s", "--upstream-timeout", "2s", "--admin-addr", "127.0.0.1:0")
	px := pp.URL
	// A 3 s lease: the retry right after the 502 must land before the lease
	// lapses (a 1 s lease, renewed every 1/3 s, left it under 700 ms on a
	// loaded machine); the sleeps below wait it out.
	const pastLease = 3500 * time.Millisecond

	if resp, err := http.Get(pp.Admin + "/healthz"); err != nil || resp.StatusCode != 200 {
		t.Fatalf("/healthz: %v %v", resp, err)
	}

	// The upstream commits the order, then dies before it answers.
	done := make(chan proxyAnswer, 1)
	go func() { done <- proxyPost(t, px+"/orders", "k-kill", `{"cart_id":"kill","sleep_ms":30000}`) }()
	deadline := time.Now().Add(30 * time.Second)
	for app.Executions(t) != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the upstream never executed the order")
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = app.Cmd.Process.Kill()
	if a := <-done; a.status != 502 || a.code != "upstream_failed" {
		t.Fatalf("the request whose upstream died: %d %s, want 502 upstream_failed", a.status, a.body)
	}
	if a := proxyPost(t, px+"/orders", "k-kill", `{"cart_id":"kill","sleep_ms":30000}`); a.status != 409 {
		t.Fatalf("retry while the lease runs: %d %s, want 409", a.status, a.body)
	}
	time.Sleep(pastLease)
	for range 3 {
		if a := proxyPost(t, px+"/orders", "k-kill", `{"cart_id":"kill","sleep_ms":30000}`); a.status != 503 || a.code != "idempotency_outcome_unknown" {
			t.Fatalf("retry after the lease lapsed: %d %s, want 503 idempotency_outcome_unknown", a.status, a.body)
		}
	}
	// The operator looks at the upstream's database (one order), and resolves.
	code, out, errOut := runIdem(t, dir, nil, "resolve", "--db", keysDB, "--scope", "t1", "--status", "201",
		"--header", "Content-Type: application/json", "--body", `{"id":"ord_1","resolved":true}`, "k-kill")
	if code != 0 {
		t.Fatalf("idem resolve: exit %d\n%s%s", code, out, errOut)
	}
	a := proxyPost(t, px+"/orders", "k-kill", `{"cart_id":"kill","sleep_ms":30000}`)
	if a.status != 201 || a.body != `{"id":"ord_1","resolved":true}` || a.header.Get("Idempotent-Replayed") != "true" || a.header.Get("Content-Type") != "application/json" {
		t.Fatalf("after idem resolve: %d %v %s, want the resolved 201, replayed", a.status, a.header, a.body)
	}

	// The upstream comes back on its port; a call that times out is unknown too,
	// and this time the operator releases the key: the retry runs it.
	app = pyorders.Start(t, ordersDB, "--port", app.Port)
	if a := proxyPost(t, px+"/orders", "k-slow", `{"cart_id":"slow","sleep_ms":3000}`); a.status != 504 || a.code != "upstream_timeout" {
		t.Fatalf("slow upstream: %d %s, want 504 upstream_timeout", a.status, a.body)
	}
	time.Sleep(pastLease)
	if a := proxyPost(t, px+"/orders", "k-slow", `{"cart_id":"slow","sleep_ms":3000}`); a.status != 503 || a.code != "idempotency_outcome_unknown" {
		t.Fatalf("after the timeout and the lease: %d %s, want 503 idempotency_outcome_unknown", a.status, a.body)
	}
	if code, out, errOut := runIdem(t, dir, nil, "resolve", "--db", keysDB, "--scope", "t1", "--release", "k-slow"); code != 0 {
		t.Fatalf("idem resolve --release: exit %d\n%s%s", code, out, errOut)
	}
	before := app.Executions(t)
	if a := proxyPost(t, px+"/orders", "k-slow", `{"cart_id":"slow","sleep_ms":3000}`); a.status != 504 {
		t.Fatalf("the retry after the release: %d %s, want it sent upstream again (and time out again)", a.status, a.body)
	}
	if n := app.Executions(t); n != before+1 {
		t.Errorf("upstream executions after the release: %d, want %d", n, before+1)
	}
	resp, err := http.Get(pp.Admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	m, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 || !strings.Contains(string(m), `idem_requests_total{outcome="replayed"} 1`) {
		t.Errorf("/metrics: %d, no replayed request counted:\n%.2000s", resp.StatusCode, m)
	}
}

// TestProxyInFlightWait: with --in-flight-wait, retries that reach the proxy
// while the upstream still runs the first request wait for its answer and get
// the replay, not 409 idempotency_key_in_use (a client like stripe-go, which
// ignores Retry-After and gives up after its retries, then never hears the
// outcome). One execution at the upstream.
func TestProxyInFlightWait(t *testing.T) {
	t.Parallel()
	var executions atomic.Int32
	entered := make(chan struct{}, 1)
	gate := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		executions.Add(1)
		entered <- struct{}{}
		<-gate
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"o1"}`)
	}))
	t.Cleanup(up.Close)
	defer func() {
		select {
		case <-gate:
		default:
			close(gate)
		}
	}()
	p := startProxyProc(t, "--upstream", up.URL, "--db", "sqlite:"+filepath.Join(t.TempDir(), "keys.db"),
		"--route", "POST /orders", "--scope-header", "X-Tenant-ID", "--in-flight-wait", "2m")
	const key = "wait-1"
	first := make(chan proxyAnswer, 1)
	go func() { first <- proxyPost(t, p.URL+"/orders", key, `{"cart_id":"c1"}`) }()
	<-entered
	const dups = 8
	answers := make(chan proxyAnswer, dups)
	for range dups {
		go func() { answers <- proxyPost(t, p.URL+"/orders", key, `{"cart_id":"c1"}`) }()
	}
	time.Sleep(300 * time.Millisecond) // most duplicates are waiting by now; a late one gets the replay anyway
	close(gate)
	if a := <-first; a.status != http.StatusCreated || a.header.Get("Idempotent-Replayed") != "" {
		t.Fatalf("first: %d %q %s", a.status, a.header.Get("Idempotent-Replayed"), a.body)
	}
	for range dups {
		a := <-answers
		if a.status != http.StatusCreated || a.header.Get("Idempotent-Replayed") != "true" || a.body != `{"id":"o1"}` {
			t.Errorf("duplicate: %d replayed=%q code %q body %s; want the replayed 201", a.status, a.header.Get("Idempotent-Replayed"), a.code, a.body)
		}
	}
	if n := executions.Load(); n != 1 {
		t.Errorf("%d executions at the upstream, want 1", n)
	}
}
