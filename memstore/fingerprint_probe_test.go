package memstore_test

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// A custom FingerprintFunc may return any bytes: whatever it returns, the
// memstore (which packs the usual "vN:" and 64 hex digits into 32 bytes and
// keeps any other form as it is) replays a retry with the same fingerprint,
// answers 422 to one with another of its version — including fingerprints that differ from a
// packable one only in the case of a digit, by a leading 0x00 or 0x01, or that
// are empty — and Get returns the fingerprint exactly.
func TestCustomFingerprintsThroughTheMiddleware(t *testing.T) {
	hex64 := strings.Repeat("0123456789abcdef", 4)
	fps := []string{
		"v2:" + hex64, "v2:" + strings.ToUpper(hex64), "\x00v2:" + hex64, "\x01v2:" + hex64,
		"", "\x00", "\x01", "\x01\x01", "\x00\x00", "v2:" + hex64[:63] + "g",
		"x:" + hex64, "v\x00:" + hex64, "v2:" + hex64 + ":" + hex64,
		strings.Repeat("\xff", 300), strings.Repeat("v9:", 5000),
		"\x00v2:" + strings.ToUpper(hex64), "\x01v2:" + strings.ToUpper(hex64), "v\x00:" + strings.ToUpper(hex64),
		"v2:" + hex64[:62] + "ff", "v2:", "v2:" + hex64 + "0",
	}
	// The middleware answers 422 when the versions agree or the stored one is
	// a known algorithm's; a stored version it knows no algorithm for counts as
	// a match (fingerprint.go).
	version := func(fp string) string {
		if i := strings.IndexByte(fp, ':'); i >= 0 {
			return fp[:i]
		}
		return ""
	}
	wantMismatch := func(stored, current string) bool {
		v := version(stored)
		return v == version(current) || v == "v1" || v == "v2"
	}
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	var runs atomic.Int64
	mw, err := idem.New(store, &idem.Config{
		// The body names the fingerprint by its index in fps.
		FingerprintFunc: func(_ *http.Request, body []byte) string {
			var i int
			for _, c := range string(body) {
				i = i*10 + int(c-'0')
			}
			return fps[i]
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "created")
	})))
	t.Cleanup(srv.Close)
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}
	post := func(key string, fp int) int {
		t.Helper()
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(itoa(fp)))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", key)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.Header.Get(idem.ReplayedHeader) == "true" {
			return -resp.StatusCode
		}
		return resp.StatusCode
	}
	for i, fp := range fps {
		key := "fp-" + itoa(i)
		if got := post(key, i); got != http.StatusCreated {
			t.Fatalf("fingerprint %q: first request %d", fp, got)
		}
		if got := post(key, i); got != -http.StatusCreated {
			t.Fatalf("fingerprint %q: retry with the same fingerprint %d, want a replayed 201", fp, got)
		}
		for j, other := range fps {
			if j == i || !wantMismatch(fp, other) {
				continue
			}
			if got := post(key, j); got != http.StatusUnprocessableEntity {
				t.Fatalf("key of fingerprint %q, retried with %q: %d, want 422", fp, other, got)
			}
		}
		rec, err := store.Get(t.Context(), "", key, time.Now())
		if err != nil || rec.Fingerprint != fp {
			t.Fatalf("Get: fingerprint %q, %v; want %q", rec.Fingerprint, err, fp)
		}
	}
	if n := runs.Load(); n != int64(len(fps)) {
		t.Fatalf("%d executions, want %d", n, len(fps))
	}
}

func itoa(i int) string {
	if i < 10 {
		return string(rune('0' + i))
	}
	return itoa(i/10) + string(rune('0'+i%10))
}
