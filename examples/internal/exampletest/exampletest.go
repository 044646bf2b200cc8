// Package exampletest holds what the store examples' tests share: a burst of
// requests with one key released at the same moment, a keyed POST, random
// names for each test's own schema, database or key prefix, running the
// example's command as a user does, and waiting for its janitor.
package exampletest

import (
	"bufio"
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"net/http"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// listening is the line every example logs once it accepts connections.
var listening = regexp.MustCompile(`listening on ((?:http|grpc)://\S+)`)

// RunMain builds the example in the working directory (the test's package)
// and runs it with args, as `go run . ARGS` would, until the test ends. It
// returns the URL of the "listening on" line the example logs once it accepts
// connections.
func RunMain(t *testing.T, args ...string) string {
	t.Helper()
	return Start(t, Build(t), args...)
}

// Build builds the example in the working directory (the test's package) and
// returns the binary's path.
func Build(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "example")
	build := exec.Command("go", "build", "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// Start runs bin with args until the test ends, and returns the URL of the
// "listening on" line it logs once it accepts connections.
func Start(t *testing.T, bin string, args ...string) string {
	t.Helper()
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, bin, args...)
	cmd.Dir = dir
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cancel(); _ = cmd.Wait() })
	found := make(chan string, 1)
	var mu sync.Mutex
	var log strings.Builder
	go func() {
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			mu.Lock()
			log.WriteString(sc.Text() + "\n")
			mu.Unlock()
			if m := listening.FindStringSubmatch(sc.Text()); m != nil {
				found <- m[1]
			}
		}
		close(found)
	}()
	select {
	case u, ok := <-found:
		if ok {
			return u
		}
	case <-time.After(2 * time.Minute):
	}
	mu.Lock()
	defer mu.Unlock()
	t.Fatalf("example %v did not log its listening address; it logged:\n%s", args, log.String())
	return ""
}

// WaitGone polls gone (every 10ms, for at most a minute) until it reports true,
// and fails the test when it never does: for a janitor whose sweeps run in the
// background.
func WaitGone(t *testing.T, what string, gone func() (bool, error)) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		ok, err := gone()
		if err != nil {
			t.Fatal(err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is still there a minute later: nothing deletes it", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Burst sends n identical requests with one key at the same moment and returns
// the body of the 201 they share; every other answer must be 409 in flight.
func Burst(t *testing.T, url, key string, n int) string {
	t.Helper()
	type answer struct {
		status int
		body   string
	}
	answers := make([]answer, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i].status, _, answers[i].body = Post(t, url, key)
		}()
	}
	close(start)
	wg.Wait()
	created := ""
	for _, a := range answers {
		switch {
		case a.status == http.StatusCreated && (created == "" || created == a.body):
			created = a.body
		case a.status == http.StatusConflict:
		default:
			t.Fatalf("answer %d %q in a burst with one key; want one 201 body (replayed or not) and 409s; all: %v", a.status, a.body, answers)
		}
	}
	if created == "" {
		t.Fatalf("no 201 among %d requests with one key: %v", n, answers)
	}
	return created
}

// Post sends one keyed order to url on the default client and returns the
// status, the Idempotent-Replayed header and the body.
func Post(t *testing.T, url, key string) (status int, replayed, body string) {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"cart_id":"c_42"}`))
	if err != nil {
		t.Error(err)
		return 0, "", ""
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return 0, "", ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(b)
}

// RandomHex returns 12 random hex digits, for names of a test's own.
func RandomHex(t *testing.T) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
