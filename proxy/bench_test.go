package proxy_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/proxy"
)

// BenchmarkOverhead compares, over loopback HTTP, first-time keyed POSTs sent
// to a Go upstream directly, through httputil.ReverseProxy alone, and through
// the idem proxy (memstore and SQLite), at 1, 8 and 64 concurrent clients:
//
//	go test -run '^$' -bench Overhead -benchtime 3s ./proxy
func BenchmarkOverhead(b *testing.B) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/1")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":"ord_1","cart_id":"c_42","total_cents":1900}`)
	}))
	defer up.Close()
	u, _ := url.Parse(up.URL)
	quiet := log.New(io.Discard, "", 0)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.Transport = &http.Transport{MaxIdleConnsPerHost: 256}
	rp.ErrorLog = quiet
	rpSrv := httptest.NewServer(rp)
	defer rpSrv.Close()
	newProxy := func(store idem.Store) *httptest.Server {
		p, err := proxy.New(proxy.Config{Upstream: u, Store: store, Scope: proxy.NoScope(), ErrorLog: quiet})
		if err != nil {
			b.Fatal(err)
		}
		return httptest.NewServer(p)
	}
	mem := newProxy(memstore.New(nil))
	defer mem.Close()
	sq := newProxy(sqliteStore(b))
	defer sq.Close()
	targets := []struct{ name, url string }{{"direct", up.URL}, {"reverseproxy", rpSrv.URL}, {"idem-memstore", mem.URL}, {"idem-sqlite", sq.URL}}
	var seq atomic.Int64
	for _, clients := range []int{1, 8, 64} {
		for _, tg := range targets {
			b.Run(fmt.Sprintf("clients=%d/%s", clients, tg.name), func(b *testing.B) {
				c := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: clients}}
				var next atomic.Int64
				var wg sync.WaitGroup
				b.ResetTimer()
				for range clients {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for next.Add(1) <= int64(b.N) {
							req, _ := http.NewRequest("POST", tg.url+"/orders", strings.NewReader(`{"cart_id":"c_42","total_cents":1900}`))
							req.Header.Set("Idempotency-Key", "bench-"+strconv.FormatInt(seq.Add(1), 10))
							resp, err := c.Do(req)
							if err != nil {
								b.Error(err)
								return
							}
							_, _ = io.Copy(io.Discard, resp.Body)
							resp.Body.Close()
							if resp.StatusCode != http.StatusCreated {
								b.Errorf("status %d", resp.StatusCode)
								return
							}
						}
					}()
				}
				wg.Wait()
				b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "req/s")
			})
		}
	}
}
