package idem

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The default fingerprint, computed into the request's own memory, is
// FingerprintV3's, for bodies kept in the request's memory and larger ones.
func TestDefaultFingerprintIsV3(t *testing.T) {
	for _, size := range []int{0, 1, smallBody, smallBody + 1, 5000} {
		body := strings.Repeat("b", size)
		var stored []string
		store := &claimRecorder{claimed: &stored}
		mw, err := New(store, nil)
		if err != nil {
			t.Fatal(err)
		}
		var seen string
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			seen = string(b)
		}))
		r := httptest.NewRequest(http.MethodPost, "/orders/a%2Fb?x=1", strings.NewReader(body))
		r.Header.Set("Idempotency-Key", "k")
		h.ServeHTTP(httptest.NewRecorder(), r)
		want := FingerprintV3(httptest.NewRequest(http.MethodPost, "/orders/a%2Fb?x=1", nil), []byte(body))
		if len(stored) != 1 || stored[0] != want {
			t.Errorf("body of %d bytes: claimed with %q, want %q", size, stored, want)
		}
		if seen != body {
			t.Errorf("body of %d bytes: the handler read %d bytes, want all of it", size, len(seen))
		}
	}
}

// claimRecorder is a nopStore that notes the fingerprint of every claim and
// grants it.
type claimRecorder struct {
	nopStore
	claimed *[]string
}

func (s *claimRecorder) Claim(_ context.Context, c ClaimRequest) (*Record, bool, error) {
	*s.claimed = append(*s.claimed, c.Fingerprint)
	return &Record{Scope: c.Scope, Key: c.Key, State: StateInFlight, Fingerprint: c.Fingerprint, Token: c.Token, CreatedAt: c.Now, LeaseUntil: c.LeaseUntil, ExpiresAt: c.ExpiresAt}, true, nil
}

// A Store that keeps the strings of a claim (a user's own Store, holding
// ClaimRequest.Fingerprint and Token in its records) keeps a few bytes per
// record alive, not the request with its recorder and buffered answer: the
// default fingerprint and the first token live in an allocation of their own.
func TestKeptClaimStringsPinNoRequest(t *testing.T) {
	var kept []string
	store := &keepingStore{kept: &kept}
	mw, err := New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	answer := strings.Repeat("a", 64<<10)
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, answer)
	}))
	const n = 200
	run := func(from int) {
		for i := from; i < from+n; i++ {
			r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"cart":1}`))
			r.Header.Set("Idempotency-Key", "k-"+strconv.Itoa(i))
			h.ServeHTTP(httptest.NewRecorder(), r)
		}
	}
	run(0) // warm up
	before := liveHeap()
	run(n)
	grew := int64(liveHeap()) - int64(before)
	if len(kept) != 2*3*n {
		t.Fatalf("the store kept %d strings, want %d", len(kept), 2*3*n)
	}
	if limit := int64(n * 8 << 10); grew > limit {
		t.Fatalf("%d records kept %d KiB alive (%d bytes each), want under %d KiB: the strings pin their requests", n, grew>>10, grew/n, limit>>10)
	}
	runtime.KeepAlive(kept)
}

func liveHeap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// keepingStore is a nopStore that grants every claim and keeps the
// fingerprint and token strings it is handed, as a Store's records would.
type keepingStore struct {
	nopStore
	kept *[]string
}

func (s *keepingStore) Claim(_ context.Context, c ClaimRequest) (*Record, bool, error) {
	*s.kept = append(*s.kept, c.Fingerprint, c.Token)
	return &Record{Scope: c.Scope, Key: c.Key, State: StateInFlight, Fingerprint: c.Fingerprint, Token: c.Token, CreatedAt: c.Now, LeaseUntil: c.LeaseUntil, ExpiresAt: c.ExpiresAt}, true, nil
}

func (s *keepingStore) Complete(_ context.Context, _, _, token string, _ *Response, _, _ time.Time) error {
	*s.kept = append(*s.kept, token)
	return nil
}
