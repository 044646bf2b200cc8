// Command lossy-orders shows what the idem client is for. It starts an
// idem-protected orders service on loopback, puts a lossy TCP proxy in front of
// it — the proxy lets the service take the order and answer, then resets the
// connection so that the answer never arrives — and places orders through it
// twice:
//
//   - with client.Transport, which sends one Idempotency-Key per order and the
//     same key with every retry: every order is created exactly once;
//   - with a naive retry loop that makes a new key per attempt (as if the key were
//     a request ID): every lost answer becomes a duplicate order.
//
// Usage:
//
//	go run ./examples/lossy-orders [-n 200] [-workers 8] [-drop 0.3]
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/client"
	"github.com/idemkit/idem/client/clienttest"
	"github.com/idemkit/idem/memstore"
)

func main() {
	n := flag.Int("n", 200, "orders to place in each run")
	workers := flag.Int("workers", 8, "orders placed at the same time")
	drop := flag.Float64("drop", 0.3, "fraction of connections whose answer the proxy loses (0 to 1, below 1)")
	flag.Parse()
	if *n < 1 || *workers < 1 || *drop < 0 || *drop >= 1 {
		fmt.Fprintln(os.Stderr, "lossy-orders: -n and -workers must be at least 1, and -drop a fraction from 0 up to (not including) 1")
		os.Exit(2)
	}
	log.SetFlags(0)

	fmt.Printf("%d orders, %d at a time, through a proxy that loses %.0f%% of answers after the service took the order\n\n", *n, *workers, 100**drop)
	idemRun := run("client.Transport (one key per order)", *n, *workers, *drop, func(c *http.Client, url, body string) error {
		resp, err := c.Post(url, "application/json", strings.NewReader(body))
		if err != nil {
			return err
		}
		return check(resp)
	}, true)
	run("naive retries (a new key per attempt)", *n, *workers, *drop, func(c *http.Client, url, body string) error {
		var err error
		for range 20 {
			var resp *http.Response
			if resp, err = c.Post(url, "application/json", strings.NewReader(body)); err == nil {
				return check(resp)
			}
		}
		return err
	}, false)
	if idemRun != *n {
		os.Exit(1) // cannot happen: the idem client created an order twice, or lost one
	}
}

// run starts a fresh service and proxy, places n orders with place, and returns
// how many orders the service created. With retrying, the client is an idem
// client.Transport; otherwise a Transport that makes no retries of its own, so
// place's loop sends each attempt with a new key.
func run(name string, n, workers int, drop float64, place func(c *http.Client, url, body string) error, retrying bool) int {
	svc, err := startService()
	if err != nil {
		log.Fatal(err)
	}
	defer svc.close()
	proxy, err := clienttest.NewProxy(svc.addr, drop, 0)
	if err != nil {
		log.Fatal(err)
	}
	defer proxy.Close()

	tr := &client.Transport{
		// A fresh connection per attempt keeps net/http from re-sending a keyed
		// request on its own, so attempts are counted exactly.
		Base:        &http.Transport{DisableKeepAlives: true},
		MaxAttempts: 20,
		MinBackoff:  time.Millisecond,
		MaxBackoff:  50 * time.Millisecond,
	}
	if !retrying {
		tr.MaxAttempts = 1
	}
	c := client.New(tr)

	var failed atomic.Int64
	jobs := make(chan int)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for i := range jobs {
				body := fmt.Sprintf(`{"cart_id":"cart-%05d"}`, i)
				if err := place(c, proxy.URL()+"/orders", body); err != nil {
					failed.Add(1)
					log.Printf("order %d: %v", i, err)
				}
			}
		})
	}
	start := time.Now()
	for i := range n {
		jobs <- i
	}
	close(jobs)
	wg.Wait()

	created, carts := svc.count()
	st := proxy.Stats()
	fmt.Printf("%s\n", name)
	fmt.Printf("  operations:      %d (%d failed) in %v\n", n, failed.Load(), time.Since(start).Round(time.Millisecond))
	fmt.Printf("  answers lost:    %d of %d (%.1f%%)\n", st.Dropped, st.Answered, 100*float64(st.Dropped)/float64(max(st.Answered, 1)))
	fmt.Printf("  replays served:  %d\n", svc.replays.Load())
	fmt.Printf("  orders created:  %d for %d carts", created, carts)
	if created > carts {
		fmt.Printf("  <- %d duplicates", created-carts)
	}
	fmt.Printf("\n\n")
	return created
}

// check reads an answer and turns anything but 201 into an error.
func check(resp *http.Response) error {
	defer resp.Body.Close()
	var o struct {
		OrderID int    `json:"order_id"`
		CartID  string `json:"cart_id"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&o); err != nil || resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("answer %s (%v)", resp.Status, err)
	}
	return nil
}

// service is the idem-protected orders service.
type service struct {
	addr    string
	srv     *http.Server
	store   *memstore.Store
	replays atomic.Int64

	mu     sync.Mutex
	orders []string // cart IDs, one per order created
}

func startService() (*service, error) {
	s := &service{store: memstore.New(nil)}
	mw, err := idem.New(s.store, &idem.Config{Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		if e.Kind == idem.EventReplayed {
			s.replays.Add(1)
		}
	})})
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", mw(http.HandlerFunc(s.createOrder)))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s.addr = ln.Addr().String()
	s.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := s.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Print(err)
		}
	}()
	return s, nil
}

func (s *service) createOrder(w http.ResponseWriter, r *http.Request) {
	var in struct {
		CartID string `json:"cart_id"`
	}
	if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.CartID == "" {
		http.Error(w, `send {"cart_id": "…"}`, http.StatusBadRequest)
		return
	}
	s.mu.Lock()
	s.orders = append(s.orders, in.CartID)
	id := len(s.orders)
	s.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", fmt.Sprintf("/orders/%d", id))
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]any{"order_id": id, "cart_id": in.CartID})
}

// count returns the orders created and the distinct carts they are for.
func (s *service) count() (orders, carts int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	seen := map[string]bool{}
	for _, c := range s.orders {
		seen[c] = true
	}
	return len(s.orders), len(seen)
}

func (s *service) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = s.srv.Shutdown(ctx)
	_ = s.store.Close()
}
