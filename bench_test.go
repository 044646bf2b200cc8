package idem_test

import (
	"fmt"
	"net/http"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// discardWriter is a ResponseWriter that keeps nothing, so that benchmarks
// measure the middleware and the handler, not a recorder.
type discardWriter struct{ h http.Header }

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *discardWriter) WriteHeader(int)             {}

// cpuPerOp reports the process's CPU time per operation (user and system, the
// garbage collector's workers included) as cpu-ns/op. Unlike ns/op it does not
// grow when other processes take the machine's cores. Call the returned
// function after the loop.
func cpuPerOp(b *testing.B) func() {
	start := cpuTime()
	return func() {
		b.ReportMetric(float64(cpuTime()-start)/float64(b.N), "cpu-ns/op")
	}
}

func cpuTime() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// benchHandler is the work every variant does: a small JSON answer.
var benchHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/orders/42")
	w.WriteHeader(http.StatusCreated)
	_, _ = w.Write([]byte(`{"id":42,"cart_id":"c_42","total_cents":1900}`))
})

const benchBody = `{"cart_id":"c_42","total_cents":1900}`

func benchRequest(key string) *http.Request {
	r, _ := http.NewRequest(http.MethodPost, "http://example.com/orders", strings.NewReader(benchBody))
	r.ContentLength = int64(len(benchBody))
	if key != "" {
		r.Header.Set("Idempotency-Key", key)
	}
	return r
}

// BenchmarkMiddleware compares the bare handler with first-time keyed requests
// and replays on memstore. Every variant builds its request inside the loop the
// same way, so the differences between them are the middleware's cost.
func BenchmarkMiddleware(b *testing.B) {
	store := memstore.New(&memstore.Config{JanitorInterval: -1})
	defer store.Close()
	mw, err := idem.New(store, nil)
	if err != nil {
		b.Fatal(err)
	}
	protected := mw(benchHandler)

	b.Run("bare", func(b *testing.B) {
		b.ReportAllocs()
		w := &discardWriter{h: http.Header{}}
		defer cpuPerOp(b)()
		for b.Loop() {
			clear(w.h)
			benchHandler.ServeHTTP(w, benchRequest(""))
		}
	})
	// Keys are made up front so that making them is not counted. Each run of the
	// sub-benchmark uses a fresh store, so every key is first-time. They are
	// slices of one pointer-free string: a million separate key strings would
	// give the collector a million objects to mark in every cycle, a cost of
	// the benchmark that a server, whose keys come and go with their requests,
	// does not have.
	const keyCount, keyWidth = 1 << 20, len("first-") + 7
	var all strings.Builder
	all.Grow(keyCount * keyWidth)
	for i := range keyCount {
		fmt.Fprintf(&all, "first-%07d", i)
	}
	keySpace := all.String()
	key := func(i int64) string {
		j := int(i % keyCount)
		return keySpace[j*keyWidth : (j+1)*keyWidth]
	}
	var seq atomic.Int64
	b.Run("first-time", func(b *testing.B) {
		store := memstore.New(&memstore.Config{JanitorInterval: -1})
		defer store.Close()
		mw, err := idem.New(store, nil)
		if err != nil {
			b.Fatal(err)
		}
		protected := mw(benchHandler)
		b.ReportAllocs()
		w := &discardWriter{h: http.Header{}}
		defer cpuPerOp(b)()
		for b.Loop() {
			clear(w.h)
			protected.ServeHTTP(w, benchRequest(key(seq.Add(1))))
		}
	})
	b.Run("replay", func(b *testing.B) {
		b.ReportAllocs()
		w := &discardWriter{h: http.Header{}}
		protected.ServeHTTP(w, benchRequest("replayed"))
		if w.h.Get("Location") == "" {
			b.Fatal("the first request was not executed")
		}
		defer cpuPerOp(b)()
		for b.Loop() {
			clear(w.h)
			protected.ServeHTTP(w, benchRequest("replayed"))
		}
	})
}
