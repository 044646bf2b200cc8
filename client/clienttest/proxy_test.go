package clienttest_test

import (
	"bufio"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/client/clienttest"
)

// proxyGoroutines returns the stacks of the goroutines running the proxy's
// code, except those that have finished their work: a goroutine that Close
// waits for may still be returning from its deferred wg.Done when Close returns.
func proxyGoroutines(t *testing.T) []string {
	t.Helper()
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		if !runsProxyCode(g) {
			continue
		}
		if !atWaitGroupDone(t, g) {
			out = append(out, g)
		}
	}
	return out
}

// runsProxyCode reports whether one of the frames of the goroutine stack g is
// in the proxy's code. The "created by" line names the function that started
// the goroutine, not one it runs: a goroutine in runtime.goexit, past its
// deferred calls, has nothing but that line.
func runsProxyCode(g string) bool {
	for _, l := range strings.Split(g, "\n") {
		if strings.Contains(l, "clienttest.(*Proxy)") && !strings.HasPrefix(strings.TrimSpace(l), "created by ") {
			return true
		}
	}
	return false
}

// atWaitGroupDone reports whether the innermost proxy frame of the goroutine
// stack g is at a "defer p.wg.Done()" line or at the closing brace of the
// function (returning through its deferred calls).
func atWaitGroupDone(t *testing.T, g string) bool {
	lines := strings.Split(g, "\n")
	for i, l := range lines {
		if !strings.Contains(l, "clienttest.(*Proxy)") || strings.HasPrefix(strings.TrimSpace(l), "created by ") || i+1 >= len(lines) {
			continue
		}
		loc := strings.Fields(strings.TrimSpace(lines[i+1]))[0] // /path/proxy.go:166
		file, line, ok := strings.Cut(loc, ".go:")
		if !ok {
			return false
		}
		src, err := os.ReadFile(file + ".go")
		if err != nil {
			t.Fatal(err)
		}
		n, _ := strconv.Atoi(line)
		srcLines := strings.Split(string(src), "\n")
		if n < 1 || n > len(srcLines) {
			return false
		}
		// The deferred Done, or the closing brace of a function running its
		// deferred calls, the last of which is Done.
		src1 := strings.TrimSpace(srcLines[n-1])
		return src1 == "defer p.wg.Done()" || src1 == "}" || src1 == "}()"
	}
	return false
}

// TestCloseWaitsForEveryGoroutine: when Close returns, none of the proxy's
// goroutines is left, the client→server copies included. Connections are open
// mid-request (the server never answers) when the proxy closes.
func TestCloseWaitsForEveryGoroutine(t *testing.T) {
	// Not parallel: it inspects every goroutine of the test binary. A goroutine
	// Close does not wait for outlives it by microseconds only, so the test
	// closes many proxies, each with many connections in flight.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var read sync.WaitGroup
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				if _, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
					read.Done()
				}
				_, _ = io.Copy(io.Discard, c) // never answer
			}()
		}
	}()
	for round := range 100 {
		p, err := clienttest.NewProxy(ln.Addr().String(), float64(round%2), uint64(round+1))
		if err != nil {
			t.Fatal(err)
		}
		const conns = 20
		read.Add(conns)
		var clients []net.Conn
		for range conns {
			c, err := net.Dial("tcp", p.Addr())
			if err != nil {
				t.Fatal(err)
			}
			clients = append(clients, c)
			if _, err := io.WriteString(c, "POST /orders HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n"); err != nil {
				t.Fatal(err)
			}
		}
		read.Wait() // every request went through both copies
		_ = p.Close()
		if left := proxyGoroutines(t); len(left) > 0 {
			t.Fatalf("round %d: %d proxy goroutines still run after Close returned; the first:\n%s", round, len(left), left[0])
		}
		for _, c := range clients {
			_ = c.Close()
		}
	}
}

// TestInterimAnswerIsNotTheAnswer: a 1xx interim answer (here 103 Early Hints,
// sent before the handler does its work) is passed on; the proxy drops the
// final answer, and counts one dropped answer only once the server has carried
// the request out.
func TestInterimAnswerIsNotTheAnswer(t *testing.T) {
	t.Parallel()
	var executed atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		time.Sleep(300 * time.Millisecond) // the work, after the interim answer
		executed.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	p, err := clienttest.NewProxy(strings.TrimPrefix(srv.URL, "http://"), 1, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	var hints atomic.Int64
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	req, _ := http.NewRequest(http.MethodPost, p.URL()+"/orders", strings.NewReader(`{}`))
	req = req.WithContext(httptraceWith1xx(req, &hints))
	_, err = c.Do(req)
	done := executed.Load() // when the client learns the answer is lost
	if err == nil {
		t.Fatal("the lossy proxy passed the final answer on")
	}
	st := p.Stats()
	if done != 1 || st.Dropped != 1 || st.Answered != 1 {
		t.Fatalf("when the client lost its answer the server had executed %d times; proxy answered %d, dropped %d; want the drop after the one execution", done, st.Answered, st.Dropped)
	}
	if hints.Load() != 1 {
		t.Errorf("the client got %d interim answers, want the 103 passed on", hints.Load())
	}
}
