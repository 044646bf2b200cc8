package idemslog_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemslog"
	"github.com/idemkit/idem/memstore"
)

// quotingStore fails every claim with an error that names the key and scope
// the ways real stores do: raw, Go-quoted (redisstore's %q) and Go-quoted cut
// to its first 64 bytes (pgstore's quoteShort for a long key).
type quotingStore struct{ idem.Store }

func (quotingStore) Claim(_ context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	short := fmt.Sprintf("%q", req.Key)
	if len(req.Key) > 64 {
		short = fmt.Sprintf("%q… (%d bytes)", req.Key[:64], len(req.Key))
	}
	return nil, false, fmt.Errorf("store: record for key %s in scope %q (raw %s / %s) is malformed", short, req.Scope, req.Key, req.Scope)
}

// TestStoreErrorsNamingTheKeyAreRedacted: idem.err carries the store's error,
// and store errors quote the key (pgstore, redisstore). Without RawKeys the
// log must still hold hashes only: hostile keys with quotes and backslashes, a
// 255-byte key and a scope with a newline, an ANSI escape and a non-UTF-8 byte
// must appear in no form.
func TestStoreErrorsNamingTheKeyAreRedacted(t *testing.T) {
	t.Parallel()
	const scope = "tenant-SECRETSCOPE\n\x1b[31m\xff"
	keys := map[string]string{ // header value → secret part of the key
		`"k-SECRETQUOTE\"x\\y"`:                   "SECRETQUOTE",
		"k-SECRETPLAIN-0001":                      "SECRETPLAIN",
		"k-SECRETLONG" + strings.Repeat("z", 243): "SECRETLONG",
	}
	var buf lockedBuf
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	obs := idemslog.New(&idemslog.Config{Logger: slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	mw, err := idem.New(quotingStore{mem}, &idem.Config{Observer: obs, MaxKeyLength: 255, ScopeFunc: func(*http.Request) string { return scope }})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })))
	t.Cleanup(srv.Close)
	for header := range keys {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", header)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 503 {
			t.Fatalf("key %s: status %d, want 503 (store error)", header, resp.StatusCode)
		}
	}
	buf.mu.Lock()
	all := buf.b.String()
	buf.mu.Unlock()
	if !strings.Contains(all, "idem.err") {
		t.Fatalf("no idem.err logged:\n%s", all)
	}
	for _, secret := range append([]string{"SECRETSCOPE"}, "SECRETQUOTE", "SECRETPLAIN", "SECRETLONG") {
		if strings.Contains(all, secret) {
			t.Errorf("%s (part of a raw key or scope) was logged without RawKeys:\n%s", secret, all)
		}
	}
}
