package memstore_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// TestStepRecordsRetainNoRequest: a step record must not keep the memory of
// the request that wrote it alive for its TTL. The middleware hands BeginStep
// strings that alias a request's own memory (the default fingerprint and the
// claim's lock token live in the request); kept as they are, each live step
// record pins the whole request, its recorder and the response it buffered.
// 400 requests each run one step and answer 503 with 64 KiB (not kept: only
// the step records stay); after a GC the heap must not have grown by anything
// near 400 × 64 KiB (25 MiB). Failed before: the heap grew by about that much.
func TestStepRecordsRetainNoRequest(t *testing.T) {
	store := memstore.New(nil)
	defer store.Close()
	mw, err := idem.New(store, &idem.Config{KeepFunc: func(s int) bool { return s < 500 }})
	if err != nil {
		t.Fatal(err)
	}
	pad := strings.Repeat("x", 64<<10)
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if _, err := idem.Step(r.Context(), "charge", func(ctx context.Context, key string) (int, error) { return 1, nil }); err != nil {
			t.Error(err)
		}
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write([]byte(pad))
	}))
	const n = 400
	heap := func() uint64 {
		runtime.GC()
		runtime.GC()
		var m runtime.MemStats
		runtime.ReadMemStats(&m)
		return m.HeapAlloc
	}
	before := heap()
	for i := range n {
		req := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(`{"amount":10}`))
		req.Header.Set("Idempotency-Key", "retain-"+strconv.Itoa(i))
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusServiceUnavailable {
			t.Fatalf("request %d: %d", i, rec.Code)
		}
	}
	after := heap()
	grown := int64(after) - int64(before)
	t.Logf("heap grew by %d KiB for %d live step records", grown>>10, n)
	if limit := int64(n) * (64 << 10) / 4; grown > limit {
		t.Errorf("the heap grew by %d KiB for %d step records (%d bytes each): they keep their requests' memory alive; want under %d KiB", grown>>10, n, grown/n, limit>>10)
	}
	runtime.KeepAlive(store)
}
