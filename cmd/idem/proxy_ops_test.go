package main

import (
	"bufio"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/pyorders"
)

// TestProxyReadyFileAndExitsWithParent (issue 26 item 3): the proxy writes
// --ready-file once its port is bound, and stops when the process that
// started it is killed, as `go run ./cmd/idem proxy … &` is. Before, there was
// no ready file, and the orphaned proxy went on answering.
func TestProxyReadyFileAndExitsWithParent(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ready := filepath.Join(dir, "proxy.ready")
	errFile := filepath.Join(dir, "stderr")
	sh := exec.Command("/bin/sh", "-c", `"$0" proxy --listen 127.0.0.1:0 --upstream http://127.0.0.1:9 --db sqlite:keys.db --scope none --ready-file "$1" 2>"$2" >/dev/null & echo "pid $!"; wait`, idemBin, ready, errFile)
	sh.Dir = dir
	sh.Env = cliEnv()
	out, err := sh.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	pid, _ := strconv.Atoi(strings.TrimPrefix(strings.TrimSpace(line), "pid "))
	if err != nil || pid == 0 {
		t.Fatalf("the shell printed %q: %v", line, err)
	}
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
	var base string
	for deadline := time.Now().Add(60 * time.Second); ; {
		if b, err := os.ReadFile(ready); err == nil && strings.HasSuffix(string(b), "\n") {
			base = strings.TrimSpace(string(b))
			break
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(errFile)
			t.Fatalf("no ready file after 60s; stderr:\n%s", log)
		}
		time.Sleep(20 * time.Millisecond)
	}
	// Ready means bound: the first request connects.
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatalf("the ready file names %s, which does not accept: %v", base, err)
	}
	_ = c.Close()
	_ = sh.Process.Kill()
	_ = sh.Wait()
	for deadline := time.Now().Add(15 * time.Second); syscall.Kill(pid, 0) == nil; {
		if time.Now().After(deadline) {
			t.Fatalf("the proxy (pid %d) still runs 15s after its parent was killed", pid)
		}
		time.Sleep(50 * time.Millisecond)
	}
	log, _ := os.ReadFile(errFile)
	if !strings.Contains(string(log), "the process that started the proxy exited") {
		t.Errorf("no stop message:\n%s", log)
	}
	if _, err := os.Stat(ready); !os.IsNotExist(err) {
		t.Errorf("the ready file is left behind: %v", err)
	}
}

// TestProxyScopeAndAdmin (issue 23 items 9 and 13, 15): a scope is required
// (--scope none warns), JWT flags without a key set are an error, --route over
// a file's routes warns, the banner lists the routes and the scope, and
// /healthz and /metrics are on --admin-addr only: on the data port they are
// the upstream's.
func TestProxyScopeAndAdmin(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	app := pyorders.Start(t, "")
	db := "sqlite:" + filepath.Join(dir, "keys.db")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--upstream", app.URL, "--db", db}, "a scope is required"},
		{[]string{"--upstream", app.URL, "--db", db, "--scope-header", "X-T", "--jwt-issuer", "https://i"}, "need --scope-jwt-claim with --jwks-file"},
		{[]string{"--upstream", app.URL, "--db", db, "--scope", "all"}, "the only value is none"},
		{[]string{"--upstream", app.URL, "--db", db, "--scope", "none", "--route", "post /orders"}, `write "POST /orders"`},
		{[]string{"--upstream", app.URL, "--db", db, "--scope", "none", "--release-status", "201"}, "not a 4xx or 5xx"},
		{[]string{"--upstream", app.URL, "--db", db, "--scope", "none", "--trust-forwarded", "10.0.0.0/33"}, "not a CIDR"},
		{[]string{"--upstream", app.URL, "--db", db, "--scope", "none", "--upstream-idle-timeout", "-1s"}, "is negative"},
	} {
		code, _, errOut := runIdem(t, dir, nil, append([]string{"proxy", "--listen", "127.0.0.1:0"}, c.args...)...)
		if code != exitUsage || !strings.Contains(errOut, c.want) {
			t.Errorf("idem proxy %q: exit %d, stderr %q; want exit 2 saying %q", c.args, code, errOut, c.want)
		}
	}
	cfg := filepath.Join(dir, "proxy.yaml")
	if err := os.WriteFile(cfg, []byte("routes:\n  - match: POST /orders\n    ttl: 1h\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	pp := startProxyProc(t, "--upstream", app.URL, "--db", db, "--scope", "none", "--config", cfg, "--route", "POST /orders", "--route", "PATCH /orders/{id}", "--admin-addr", "127.0.0.1:0")
	if !strings.Contains(pp.Banner, "keyed routes: POST /orders, PATCH /orders/{id}; scope: none") {
		t.Errorf("banner:\n%s", pp.Banner)
	}
	time.Sleep(100 * time.Millisecond)
	if e := pp.stderr.String(); !strings.Contains(e, "WARNING: --scope none") || !strings.Contains(e, "--route replaces the 1 route(s)") {
		t.Errorf("stderr has no warnings:\n%s", e)
	}
	// A keyed request on no route is counted.
	if a := proxyPost(t, pp.URL+"/headers", "unrouted", `{}`); a.status != 200 {
		t.Errorf("POST /headers: %d %s", a.status, a.body)
	}
	for _, path := range []string{"/healthz", "/metrics"} {
		resp, err := http.Get(pp.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 404 || !strings.Contains(string(b), "not found") {
			t.Errorf("data port %s: %d %s, want the upstream's 404", path, resp.StatusCode, b)
		}
		resp, err = http.Get(pp.Admin + path)
		if err != nil {
			t.Fatal(err)
		}
		b, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Errorf("admin %s: %d", path, resp.StatusCode)
		}
		if path == "/metrics" && !strings.Contains(string(b), "idem_proxy_unrouted_keyed_requests_total 1") {
			t.Errorf("/metrics does not count the unrouted keyed request:\n%.3000s", b)
		}
	}
}

// TestProxyListenerTimeouts (issue 23 item 12): a keyed body trickled slower
// than --read-timeout is cut off, and an idle client connection is closed
// after --idle-timeout. Before, neither was bounded.
func TestProxyListenerTimeouts(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	pp := startProxyProc(t, "--upstream", app.URL, "--db", "sqlite:"+filepath.Join(t.TempDir(), "keys.db"), "--scope", "none",
		"--read-timeout", "1s", "--idle-timeout", "1s")
	host := strings.TrimPrefix(pp.URL, "http://")
	c, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"cart_id":"trickle"}`
	fmt.Fprintf(c, "POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: trickle\r\nContent-Length: %d\r\n\r\n", len(body))
	cut := false
	for i := range len(body) { // 1 byte per 300 ms: 6 s in all
		if _, err := c.Write([]byte{body[i]}); err != nil {
			cut = true
			break
		}
		time.Sleep(300 * time.Millisecond)
	}
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	got, _ := io.ReadAll(c)
	if strings.Contains(string(got), "201 Created") {
		t.Errorf("a body trickled over 6 s with --read-timeout 1s was accepted (cut while writing: %v): %q", cut, got)
	}
	if n := app.Executions(t); n != 0 {
		t.Errorf("upstream executions %d, want 0", n)
	}
	// An idle keep-alive connection is closed.
	c2, err := net.Dial("tcp", host)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	fmt.Fprintf(c2, "GET /executions HTTP/1.1\r\nHost: x\r\n\r\n")
	r := bufio.NewReader(c2)
	resp, err := http.ReadResponse(r, nil)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	_ = c2.SetReadDeadline(time.Now().Add(20 * time.Second))
	if _, err := r.ReadByte(); err != io.EOF {
		t.Errorf("idle connection after --idle-timeout 1s: %v, want it closed (EOF)", err)
	}
}

// TestProxyIgnoresEnvironmentProxy (issue 23 item 17): HTTP_PROXY in the
// environment is not used (a forward proxy's 502 would have been stored as
// the upstream's answer); --upstream-proxy is.
func TestProxyIgnoresEnvironmentProxy(t *testing.T) {
	t.Parallel()
	var seen atomic.Int64
	fwd := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.Add(1)
		w.WriteHeader(201) // as if it were the upstream
		fmt.Fprint(w, `{"from":"forward proxy"}`)
	}))
	t.Cleanup(fwd.Close)
	// A name only the forward proxy could resolve: net/http never proxies
	// loopback addresses, whatever HTTP_PROXY says.
	upstream := "http://idem-upstream.invalid:8080"
	db := "sqlite:" + filepath.Join(t.TempDir(), "keys.db")
	env := []string{"HTTP_PROXY=" + fwd.URL, "http_proxy=" + fwd.URL, "NO_PROXY=", "no_proxy="}
	pp := startProxyProcEnv(t, env, "--upstream", upstream, "--db", db, "--scope", "none")
	a := proxyPost(t, pp.URL+"/orders", "env", `{}`)
	if seen.Load() != 0 || a.status != 502 || a.code != "upstream_unreachable" {
		t.Errorf("with HTTP_PROXY set: %d %s, the forward proxy saw %d requests; want 502 upstream_unreachable and none", a.status, a.body, seen.Load())
	}
	u, _ := url.Parse(fwd.URL)
	pp2 := startProxyProcEnv(t, nil, "--upstream", upstream, "--db", db, "--scope", "none", "--upstream-proxy", u.String())
	if a := proxyPost(t, pp2.URL+"/orders", "flag", `{}`); a.status != 201 || seen.Load() != 1 {
		t.Errorf("with --upstream-proxy: %d %s, forward proxy saw %d", a.status, a.body, seen.Load())
	}
}

// TestProxyDrainAbandonedKeys (issue 23 item 11): a second SIGTERM stops the
// drain at once; the key still at the upstream is logged as abandoned and the
// exit status is 1. Before, the second signal was ignored, the proxy waited
// a fixed 30 s and exited 0 without a word.
func TestProxyDrainAbandonedKeys(t *testing.T) {
	t.Parallel()
	app := pyorders.Start(t, "")
	pp := startProxyProc(t, "--upstream", app.URL, "--db", "sqlite:"+filepath.Join(t.TempDir(), "keys.db"), "--scope-header", "X-Tenant-ID",
		"--route", "POST /orders", "--upstream-timeout", "1m")
	go func() {
		// The proxy stops under it: an error, not an answer (proxyPost would fail the test).
		req, _ := http.NewRequest("POST", pp.URL+"/orders", strings.NewReader(`{"cart_id":"a","sleep_ms":60000}`))
		req.Header.Set("Idempotency-Key", "k-abandon")
		req.Header.Set("X-Tenant-ID", "t1")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	for deadline := time.Now().Add(30 * time.Second); app.Executions(t) != 1; {
		if time.Now().After(deadline) {
			t.Fatal("the upstream never executed the order")
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = pp.Cmd.Process.Signal(syscall.SIGTERM)
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(pp.stderr.String(), "waiting up to"); {
		if time.Now().After(deadline) {
			t.Fatalf("no drain message:\n%s", pp.stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if !strings.Contains(pp.stderr.String(), "waiting up to 1m11s") {
		t.Errorf("the drain is not --upstream-timeout plus the cleanup:\n%s", pp.stderr.String())
	}
	_ = pp.Cmd.Process.Signal(syscall.SIGTERM)
	exited := make(chan error, 1)
	go func() { exited <- pp.Cmd.Wait() }()
	var err error
	select {
	case err = <-exited:
	case <-time.After(20 * time.Second):
		t.Fatal("the proxy did not stop on the second SIGTERM")
	}
	ee, ok := err.(*exec.ExitError)
	if !ok || ee.ExitCode() != 1 {
		t.Errorf("exit %v, want status 1", err)
	}
	if e := pp.stderr.String(); !strings.Contains(e, `abandoned key "k-abandon" (scope "t1"`) {
		t.Errorf("the abandoned key is not logged:\n%s", e)
	}
}

// TestProxyDrainOutlastsThirtySeconds (issue 23 item 11): with
// --upstream-timeout 50s, an upstream call of 33 s and SIGTERM, the client
// gets its answer and the proxy exits 0. Before, the proxy gave up at a fixed
// 30 s: the client got an empty reply while the upstream created the order.
func TestProxyDrainOutlastsThirtySeconds(t *testing.T) {
	if testing.Short() {
		t.Skip("waits 33 s")
	}
	t.Parallel()
	app := pyorders.Start(t, "")
	pp := startProxyProc(t, "--upstream", app.URL, "--db", "sqlite:"+filepath.Join(t.TempDir(), "keys.db"), "--scope-header", "X-Tenant-ID",
		"--route", "POST /orders", "--upstream-timeout", "50s", "--lease", "10s")
	done := make(chan proxyAnswer, 1)
	go func() { done <- proxyPost(t, pp.URL+"/orders", "k-long", `{"cart_id":"l","sleep_ms":33000}`) }()
	for deadline := time.Now().Add(30 * time.Second); app.Executions(t) != 1; {
		if time.Now().After(deadline) {
			t.Fatal("the upstream never executed the order")
		}
		time.Sleep(20 * time.Millisecond)
	}
	_ = pp.Cmd.Process.Signal(syscall.SIGTERM)
	a := <-done
	if a.status != 201 {
		t.Errorf("the request in flight at SIGTERM: %d %s, want its 201", a.status, a.body)
	}
	if err := pp.Cmd.Wait(); err != nil {
		t.Errorf("exit: %v, want 0\n%s", err, pp.stderr.String())
	}
}

// TestProxyUpstreamTLSFlags (issue 23 item 2): --upstream-ca and
// --upstream-server-name reach an https upstream with a private CA; without
// them the request never reaches it, and the key is released.
func TestProxyUpstreamTLSFlags(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	up := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(201)
	}))
	t.Cleanup(up.Close)
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: up.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	db := "sqlite:" + filepath.Join(dir, "keys.db")
	plain := startProxyProc(t, "--upstream", up.URL, "--db", db, "--scope-header", "X-Tenant-ID")
	for range 2 {
		if a := proxyPost(t, plain.URL+"/orders", "tls", `{}`); a.status != 502 || a.code != "upstream_unreachable" {
			t.Fatalf("untrusted upstream: %d %s, want 502 upstream_unreachable (the key released)", a.status, a.body)
		}
	}
	trusted := startProxyProc(t, "--upstream", up.URL, "--db", db, "--scope-header", "X-Tenant-ID", "--upstream-ca", ca, "--upstream-server-name", "example.com")
	if a := proxyPost(t, trusted.URL+"/orders", "tls", `{}`); a.status != 201 || runs.Load() != 1 {
		t.Fatalf("with --upstream-ca: %d %s after %d runs", a.status, a.body, runs.Load())
	}
	if code, _, errOut := runIdem(t, dir, nil, "proxy", "--upstream", up.URL, "--db", db, "--scope", "none", "--upstream-ca", db[len("sqlite:"):]); code != exitUsage || !strings.Contains(errOut, "no PEM certificate") {
		t.Errorf("--upstream-ca with no certificate: exit %d %s", code, errOut)
	}
}
