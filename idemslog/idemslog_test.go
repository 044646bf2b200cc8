package idemslog_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
	"github.com/idemkit/idem/idemslog"
	"github.com/idemkit/idem/memstore"
)

type lockedBuf struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

type failing struct{ idem.Store }

func (failing) Claim(context.Context, idem.ClaimRequest) (*idem.Record, bool, error) {
	return nil, false, errors.New("connection refused")
}

// Release is called to give up the failed claim, in case its answer was lost.
func (failing) Release(context.Context, string, string, string) error {
	return errors.New("connection refused")
}

// run sends executed, replayed, mismatch, rejected and a store error through a
// loopback server and returns the JSON records logged.
func run(t *testing.T, cfg *idemslog.Config, buf *lockedBuf) []map[string]any {
	t.Helper()
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })
	var urls []string
	for _, s := range []idem.Store{mem, failing{mem}} {
		mw, err := idem.New(s, &idem.Config{Observer: idemslog.New(cfg), ScopeFunc: func(*http.Request) string { return "tenant-acme" }})
		if err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(mw(h))
		t.Cleanup(srv.Close)
		urls = append(urls, srv.URL)
	}
	for _, c := range []struct {
		url, key, body string
		status         int
	}{
		{urls[0], "raw-key-1", "a", 201}, {urls[0], "raw-key-1", "a", 201}, {urls[0], "raw-key-1", "b", 422},
		{urls[0], "", "a", 400}, {urls[1], "raw-key-2", "a", 503},
	} {
		req, _ := http.NewRequest("POST", c.url+"/orders", strings.NewReader(c.body))
		if c.key != "" {
			req.Header.Set("Idempotency-Key", c.key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != c.status {
			t.Fatalf("%+v: status %d", c, resp.StatusCode)
		}
	}
	buf.mu.Lock()
	defer buf.mu.Unlock()
	var recs []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(buf.b.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("%q: %v", line, err)
		}
		recs = append(recs, m)
	}
	return recs
}

// TestLogsEveryOutcome checks levels, attribute names and values, and that the
// raw key and scope appear nowhere unless RawKeys is set.
func TestLogsEveryOutcome(t *testing.T) {
	t.Parallel()
	buf := &lockedBuf{}
	logger := slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: slog.LevelDebug}))
	recs := run(t, &idemslog.Config{Logger: logger}, buf)
	want := []struct{ outcome, level string }{
		{"executed", "DEBUG"}, {"replayed", "DEBUG"}, {"mismatch", "INFO"}, {"rejected", "INFO"}, {"store_error", "ERROR"},
	}
	if len(recs) != len(want) {
		t.Fatalf("%d records, want %d: %v", len(recs), len(want), recs)
	}
	for i, w := range want {
		r := recs[i]
		if r["idem.outcome"] != w.outcome || r["level"] != w.level || r["msg"] != "idem "+w.outcome {
			t.Errorf("record %d: %v; want outcome %s at %s", i, r, w.outcome, w.level)
		}
		if _, ok := r["idem.took"]; !ok {
			t.Errorf("record %d has no idem.took: %v", i, r)
		}
		if w.outcome == "rejected" {
			if _, ok := r["idem.key_hash"]; ok {
				t.Errorf("rejected before the key was read, yet a key hash: %v", r)
			}
			continue
		}
		if r["idem.scope_hash"] != idemobs.Hash("tenant-acme") {
			t.Errorf("record %d: idem.scope_hash %v, want %s", i, r["idem.scope_hash"], idemobs.Hash("tenant-acme"))
		}
	}
	if recs[0]["idem.key_hash"] != idemobs.KeyHash("tenant-acme", "raw-key-1") || recs[0]["idem.status"] != float64(201) {
		t.Errorf("executed: %v", recs[0])
	}
	if e, _ := recs[4]["idem.err"].(string); !strings.Contains(e, "connection refused") {
		t.Errorf("store_error without its error: %v", recs[4])
	}
	all := buf.b.String()
	if strings.Contains(all, "raw-key") || strings.Contains(all, "tenant-acme") {
		t.Errorf("a raw key or scope was logged without RawKeys:\n%s", all)
	}
}

// TestRawKeysAndLevels: RawKeys adds the key and scope; records below the
// handler's level are not built.
func TestRawKeysAndLevels(t *testing.T) {
	t.Parallel()
	buf := &lockedBuf{}
	logger := slog.New(slog.NewJSONHandler(buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
	recs := run(t, &idemslog.Config{Logger: logger, RawKeys: true}, buf)
	if len(recs) != 3 {
		t.Fatalf("%d records at Info and above, want 3 (mismatch, rejected, store_error): %v", len(recs), recs)
	}
	if recs[0]["idem.key"] != "raw-key-1" || recs[0]["idem.scope"] != "tenant-acme" {
		t.Errorf("RawKeys: %v", recs[0])
	}
}

// TestKeyHashIsScoped: the same key sent by two tenants logs two key hashes
// (before, one: a key hash linked the tenants' requests), and the hash is
// idemobs.KeyHash of scope and key.
func TestKeyHashIsScoped(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	o := idemslog.New(&idemslog.Config{Logger: slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	for _, scope := range []string{"tenant-a", "tenant-b"} {
		o.Observe(context.Background(), idem.Event{Kind: idem.EventExecuted, Key: "order-42", Scope: scope, Status: 201})
	}
	var hashes []string
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var r map[string]any
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			t.Fatal(err)
		}
		h, _ := r["idem.key_hash"].(string)
		hashes = append(hashes, h)
	}
	if len(hashes) != 2 || hashes[0] == hashes[1] || hashes[0] != idemobs.KeyHash("tenant-a", "order-42") {
		t.Fatalf("key hashes %v for one key in two scopes; want two different ones, the first %s", hashes, idemobs.KeyHash("tenant-a", "order-42"))
	}
	if idemobs.KeyHash("ab", "c") == idemobs.KeyHash("a", "bc") {
		t.Fatal("KeyHash(ab, c) == KeyHash(a, bc): scope and key must not run together")
	}
}

// TestWaitSaysHowItEnded: an EventWaited record carries how the wait ended and
// how long it took (it said only "idem waited").
func TestWaitSaysHowItEnded(t *testing.T) {
	t.Parallel()
	var buf bytes.Buffer
	o := idemslog.New(&idemslog.Config{Logger: slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	o.Observe(context.Background(), idem.Event{Kind: idem.EventWaited, Key: "k", Wait: idem.WaitTimedOut, Waited: 1500 * time.Millisecond})
	var r map[string]any
	if err := json.Unmarshal(buf.Bytes(), &r); err != nil {
		t.Fatal(err)
	}
	if r["msg"] != "idem waited" || r["idem.wait"] != "timed_out" || r["idem.waited"] != float64(1500*time.Millisecond) || r["level"] != "DEBUG" {
		t.Fatalf("record %v; want msg idem waited, idem.wait timed_out, idem.waited 1.5s at DEBUG", r)
	}
}
