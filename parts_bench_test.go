package idem

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"
)

// BenchmarkParts measures, one at a time, the pieces of work the middleware
// adds to a first-time request, so that BENCHMARKS.md can say what each costs:
//
//   - fingerprint: FingerprintV2 of a POST with a 37-byte body (SHA-256 of
//     method, escaped path and body, and its hex);
//
//   - token: a lock token;
//
//   - lease: handing a running handler to the scheduler and taking it off;
//
//   - context: the handler's context, made and ended without being used;
//
//   - recorder: buffering a 45-byte answer with two headers, taking the stored
//     response (headers copied) and sending it.
//
//     go test -run '^$' -bench Parts -count 6 . | benchstat -
func BenchmarkParts(b *testing.B) {
	mw, err := New(nopStore{}, nil)
	if err != nil {
		b.Fatal(err)
	}
	h := mw(http.NotFoundHandler()).(*handler)
	body := []byte(`{"cart_id":"c_42","total_cents":1900}`)
	r, _ := http.NewRequest(http.MethodPost, "http://example.com/orders", strings.NewReader(string(body)))
	b.Run("fingerprint", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = FingerprintV2(r, body)
		}
	})
	b.Run("token", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = newToken()
		}
	})
	b.Run("lease", func(b *testing.B) {
		req := &request{h: h, r: r}
		b.ReportAllocs()
		for b.Loop() {
			req.done = false
			req.startTimer("token", true)
			req.stopRenewal()
		}
	})
	b.Run("context", func(b *testing.B) {
		req := &request{h: h, r: r}
		b.ReportAllocs()
		for b.Loop() {
			req.exec.init(r.Context(), h.handlerDeadline(), &req.rw)
			req.exec.end(nil)
		}
	})
	b.Run("recorder", func(b *testing.B) {
		w := &partsWriter{h: http.Header{}}
		b.ReportAllocs()
		for b.Loop() {
			clear(w.h)
			req := &request{h: h, r: r}
			rw := req.recorder(w)
			rw.Header().Set("Content-Type", "application/json")
			rw.Header().Set("Location", "/orders/42")
			rw.WriteHeader(http.StatusCreated)
			_, _ = rw.Write([]byte(`{"id":42,"cart_id":"c_42","total_cents":1900}`))
			stored := h.response(w, rw)
			stored.release()
			rw.send()
		}
	})
}

type partsWriter struct{ h http.Header }

func (w *partsWriter) Header() http.Header         { return w.h }
func (w *partsWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *partsWriter) WriteHeader(int)             {}

// nopStore is a Store that does nothing, for benchmarks of the middleware's own
// parts; it says it copies responses, as every store in this module does.
type nopStore struct{}

func (nopStore) Claim(context.Context, ClaimRequest) (*Record, bool, error) { return nil, false, nil }
func (nopStore) Complete(context.Context, string, string, string, *Response, time.Time, time.Time) error {
	return nil
}
func (nopStore) Release(context.Context, string, string, string) error { return nil }
func (nopStore) Extend(context.Context, string, string, string, time.Time, time.Time) error {
	return nil
}
func (nopStore) Get(context.Context, string, string, time.Time) (*Record, error) {
	return nil, ErrNotFound
}
func (nopStore) DeleteExpired(context.Context, time.Time, int) (int, error) { return 0, nil }
func (nopStore) CopiesResponses() bool                                      { return true }
