package redisstore_test

import (
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

// BenchmarkMiddleware measures one keyed POST served in process (ServeHTTP, no
// network between client and server; loopback TCP to Redis), first-time
// (claim + handler + complete) and replay (one claim script that returns the
// stored record), against the bare handler. Compare with
//
//	go test -run '^$' -bench Middleware -benchtime 2000x -count 6 ./redisstore/ > bench.txt
//	benchstat -col /store bench.txt
func BenchmarkMiddleware(b *testing.B) {
	tb := setup(b)
	bare := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/42")
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte(`{"id":"42","item":"book","quantity":1}`))
	})
	mw, err := idem.New(tb.store, nil)
	if err != nil {
		b.Fatal(err)
	}
	handlers := []struct {
		name string
		h    http.Handler
	}{{"bare", bare}, {"redis", mw(bare)}}
	const body = `{"item":"book","quantity":1}`
	serve := func(b *testing.B, h http.Handler, key string) {
		r := httptest.NewRequest(http.MethodPost, "/orders", strings.NewReader(body))
		r.Header.Set("Idempotency-Key", key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != http.StatusCreated {
			b.Fatalf("status %d: %s", w.Code, w.Body)
		}
	}
	run := 0
	for _, op := range []string{"first", "replay"} {
		for _, hh := range handlers {
			b.Run("op="+op+"/store="+hh.name, func(b *testing.B) {
				run++
				base := "bench-" + strconv.Itoa(run) + "-"
				if op == "replay" {
					serve(b, hh.h, base+"once")
				}
				b.ReportAllocs()
				b.ResetTimer()
				for i := 0; i < b.N; i++ {
					key := base + "once"
					if op == "first" {
						key = base + strconv.Itoa(i)
					}
					serve(b, hh.h, key)
				}
			})
		}
	}
}
