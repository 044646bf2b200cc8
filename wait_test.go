package idem_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/waittest"
	"github.com/idemkit/idem/memstore"
)

// TestInFlightWaitMemoryPerWaiter measures, by hand, the memory N waiters
// take (IDEM_WAIT_MEMORY=N; client and server share the process, so N
// connections take 2N file descriptors); it reports, never asserts.
func TestInFlightWaitMemoryPerWaiter(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("IDEM_WAIT_MEMORY"))
	if n <= 0 {
		t.Skip("set IDEM_WAIT_MEMORY=N to measure the memory of N waiters")
	}
	c := waittest.Client()
	// heapOf returns the heap and stacks in use once n requests to url are
	// parked (ready receives once per parked request), then unparks them.
	heapOf := func(url, key string, ready <-chan struct{}, open func()) uint64 {
		var wg sync.WaitGroup
		for range n {
			wg.Add(1)
			go func() { defer wg.Done(); waittest.Post(context.Background(), c, url, key, nil) }()
		}
		for range n {
			<-ready
		}
		var ms runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&ms)
		open()
		wg.Wait()
		return ms.HeapInuse + ms.StackInuse
	}
	var base runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&base)
	// Baseline: n requests parked in a plain handler, without idem.
	parked := waittest.NewGated()
	plain := httptest.NewServer(parked)
	t.Cleanup(plain.Close)
	withoutIdem := heapOf(plain.URL, "", parked.Entered, parked.Open)
	plain.CloseClientConnections()
	c.CloseIdleConnections()
	// n waiters on one key behind idem.
	s := memstore.New(nil)
	t.Cleanup(func() { _ = s.Close() })
	key := waittest.Key(t)
	g := waittest.NewGated()
	srv := waittest.Server(t, s, idem.Config{InFlightWait: 5 * time.Minute, InFlightMaxWaiters: n, InFlightMaxWaitersPerKey: n}, g)
	defer g.Open()
	go waittest.Post(context.Background(), c, srv.URL, key, nil)
	<-g.Entered
	waiting := heapOf(srv.URL, key, idem.WaitJoins(key), g.Open)
	t.Logf("%d requests parked: without idem %.1f KiB each (both ends of a loopback connection), waiting behind idem %.1f KiB each: idem's waiter %.0f bytes",
		n, float64(withoutIdem-base.HeapInuse-base.StackInuse)/1024/float64(n), float64(waiting-base.HeapInuse-base.StackInuse)/1024/float64(n),
		(float64(waiting)-float64(withoutIdem))/float64(n))
}

// TestInFlightWaitHangUp: a waiter whose client hangs up stops at once (long
// before InFlightWait) and frees its place: with one place per key, the next
// duplicate waits instead of getting 409.
func TestInFlightWaitHangUp(t *testing.T) {
	onMemstore(t, func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow) {
		key := waittest.Key(t)
		joins := idem.WaitJoins(key)
		ev := waittest.NewEvents(key)
		g := waittest.NewGated()
		srv := waittest.Server(t, newStore(t), idem.Config{Flow: flow, InFlightWait: 10 * time.Minute, InFlightMaxWaitersPerKey: 1, Observer: ev}, g)
		defer g.Open()
		c := waittest.Client()
		first := make(chan waittest.Answer, 1)
		go func() { first <- waittest.Post(context.Background(), c, srv.URL, key, nil) }()
		<-g.Entered
		ctx, hangUp := context.WithCancel(context.Background())
		gone := make(chan waittest.Answer, 1)
		go func() { gone <- waittest.Post(ctx, c, srv.URL, key, nil) }()
		<-joins
		hangUp()
		select {
		case o := <-ev.Ended():
			if o != idem.WaitHungUp {
				t.Fatalf("the wait ended %v, want %v", o, idem.WaitHungUp)
			}
		case <-time.After(time.Minute):
			t.Fatal("a waiter whose client hung up was still waiting a minute later")
		}
		<-gone
		next := make(chan waittest.Answer, 1)
		go func() { next <- waittest.Post(context.Background(), c, srv.URL, key, nil) }()
		select {
		case <-joins:
		case a := <-next:
			t.Fatalf("the next duplicate got %d %s without waiting: the place of the waiter that hung up was not freed", a.Status, a.Body)
		}
		g.Open()
		if a := <-next; a.Status != http.StatusCreated || !a.Replayed {
			t.Errorf("the next duplicate: %d replayed=%v, want the replay", a.Status, a.Replayed)
		}
		if f := <-first; f.Status != http.StatusCreated {
			t.Errorf("the first request: %d", f.Status)
		}
	})
}

// TestInFlightWaitFull: past InFlightMaxWaitersPerKey a duplicate gets 409 at
// once.
func TestInFlightWaitFull(t *testing.T) {
	t.Parallel()
	s := memstore.New(nil)
	t.Cleanup(func() { _ = s.Close() })
	key := waittest.Key(t)
	joins := idem.WaitJoins(key)
	ev := waittest.NewEvents(key)
	g := waittest.NewGated()
	srv := waittest.Server(t, s, idem.Config{InFlightWait: 10 * time.Minute, InFlightMaxWaitersPerKey: 2, Observer: ev}, g)
	defer g.Open()
	c := waittest.Client()
	go waittest.Post(context.Background(), c, srv.URL, key, nil)
	<-g.Entered
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() { defer wg.Done(); waittest.Post(context.Background(), c, srv.URL, key, nil) }()
		<-joins
	}
	if a := waittest.Post(context.Background(), c, srv.URL, key, nil); a.Status != http.StatusConflict || a.RetryAfter < 1 {
		t.Errorf("a third duplicate with 2 places per key: %d Retry-After %d, want 409 at once", a.Status, a.RetryAfter)
	}
	if got := ev.Waits(idem.WaitFull); got != 1 {
		t.Errorf("%d waits refused as full, want 1", got)
	}
	g.Open()
	wg.Wait()
}

// TestInFlightWaitHolderLetsGo: a holder whose outcome is not kept (500 with
// a KeepFunc that keeps only successes) releases the key, or ends its
// transaction: its waiters go on as fresh requests — one executes, the others
// wait for it and get its replay.
func TestInFlightWaitHolderLetsGo(t *testing.T) {
	onMemstore(t, func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow) {
		const n = 8
		key := waittest.Key(t)
		joins := idem.WaitJoins(key)
		ev := waittest.NewEvents(key)
		g := waittest.NewGated()
		var mu sync.Mutex
		runs := 0
		h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			runs++
			nth := runs
			mu.Unlock()
			if nth == 1 {
				g.ServeHTTP(httptest.NewRecorder(), r)
				http.Error(w, "upstream failed", http.StatusBadGateway)
				return
			}
			_, _ = fmt.Fprintf(w, "run %d", nth)
		})
		srv := waittest.Server(t, newStore(t), idem.Config{Flow: flow, InFlightWait: 10 * time.Minute, Observer: ev,
			KeepFunc: func(status int) bool { return status < 500 }}, h)
		defer g.Open()
		c := waittest.Client()
		first := make(chan waittest.Answer, 1)
		go func() { first <- waittest.Post(context.Background(), c, srv.URL, key, nil) }()
		<-g.Entered
		answers := make([]waittest.Answer, n)
		var wg sync.WaitGroup
		for i := range answers {
			wg.Add(1)
			go func() { defer wg.Done(); answers[i] = waittest.Post(context.Background(), c, srv.URL, key, nil) }()
		}
		for range n {
			<-joins
		}
		g.Open()
		wg.Wait()
		if f := <-first; f.Status != http.StatusBadGateway {
			t.Errorf("the holder: %d, want its own 502", f.Status)
		}
		executed, replayed := 0, 0
		for _, a := range answers {
			switch {
			case a.Status == 200 && string(a.Body) == "run 2" && !a.Replayed:
				executed++
			case a.Status == 200 && string(a.Body) == "run 2" && a.Replayed:
				replayed++
			default:
				t.Errorf("a waiter got %d %q replayed=%v, want run 2 (executed once, replayed to the rest)", a.Status, a.Body, a.Replayed)
			}
		}
		if executed != 1 || replayed != n-1 || runs != 2 {
			t.Errorf("after the holder let go: %d executed, %d replayed, the handler ran %d times; want 1, %d, 2", executed, replayed, runs, n-1)
		}
		if ev.Waits(idem.WaitRetried) < n {
			t.Errorf("%d waits ended as retried, want at least %d: %v", ev.Waits(idem.WaitRetried), n, ev)
		}
	})
}

// TestInFlightWaitOff: without InFlightWait a duplicate gets 409 at once, as
// before.
func TestInFlightWaitOff(t *testing.T) {
	t.Parallel()
	s := memstore.New(nil)
	t.Cleanup(func() { _ = s.Close() })
	key := waittest.Key(t)
	g := waittest.NewGated()
	srv := waittest.Server(t, s, idem.Config{}, g)
	defer g.Open()
	c := waittest.Client()
	go waittest.Post(context.Background(), c, srv.URL, key, nil)
	<-g.Entered
	if a := waittest.Post(context.Background(), c, srv.URL, key, nil); a.Status != http.StatusConflict {
		t.Errorf("a duplicate without InFlightWait: %d, want 409", a.Status)
	}
}

// TestInFlightWaitConfig: negative bounds are refused with what to do.
func TestInFlightWaitConfig(t *testing.T) {
	t.Parallel()
	for _, c := range []idem.Config{{InFlightWait: -time.Second}, {InFlightMaxWaiters: -1}, {InFlightMaxWaitersPerKey: -1}} {
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), "InFlight") {
			t.Errorf("%+v: %v, want an error naming the field", c, err)
		}
	}
}

// TestInFlightWaitDefaultPerKeyCap: with InFlightMaxWaitersPerKey left at 0,
// DefaultInFlightMaxWaitersPerKey (1000, as the README says) requests wait
// for one key, and the next gets 409 at once.
func TestInFlightWaitDefaultPerKeyCap(t *testing.T) {
	t.Parallel()
	if idem.DefaultInFlightMaxWaitersPerKey != 1000 || idem.DefaultInFlightMaxWaiters != 10000 {
		t.Fatalf("defaults %d per key, %d in all; the README documents 1000 and 10000", idem.DefaultInFlightMaxWaitersPerKey, idem.DefaultInFlightMaxWaiters)
	}
	s := memstore.New(nil)
	t.Cleanup(func() { _ = s.Close() })
	key := waittest.Key(t)
	joins := idem.WaitJoins(key)
	ev := waittest.NewEvents(key)
	g := waittest.NewGated()
	srv := waittest.Server(t, s, idem.Config{InFlightWait: 10 * time.Minute, Observer: ev}, g)
	defer g.Open()
	c := waittest.Client()
	go waittest.Post(context.Background(), c, srv.URL, key, nil)
	<-g.Entered
	const n = 1000
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() { defer wg.Done(); waittest.Post(context.Background(), c, srv.URL, key, nil) }()
	}
	for range n {
		<-joins
	}
	if a := waittest.Post(context.Background(), c, srv.URL, key, nil); a.Status != http.StatusConflict {
		t.Errorf("request %d for one key: %d, want 409 at once (the default per-key cap is %d)", n+1, a.Status, n)
	}
	if got := ev.Waits(idem.WaitFull); got != 1 {
		t.Errorf("%d waits refused as full, want 1", got)
	}
	g.Open()
	wg.Wait()
}

// onMemstore runs check on memstore; the tests that need to know when a waiter
// joined (idem.WaitJoins, a hook of the core package's own tests) run here, the
// others on memstore and SQLite in both flows in internal/coretest.
func onMemstore(t *testing.T, check func(t *testing.T, newStore func(*testing.T) idem.Store, flow idem.Flow)) {
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		check(t, func(t *testing.T) idem.Store {
			s := memstore.New(nil)
			t.Cleanup(func() { _ = s.Close() })
			return s
		}, idem.FlowAuto)
	})
}

// TestInFlightWaitManyWaitersTwoProcesses measures, by hand, N waiters on one
// key with the clients in a second process (IDEM_WAIT_PROCESSES=N; one
// process cannot hold both ends of 10,000 connections under a 20,000-file
// limit): every waiter must get the byte-exact replay, and the server's heap
// and stacks per waiting request are reported, never asserted.
func TestInFlightWaitManyWaitersTwoProcesses(t *testing.T) {
	if url := os.Getenv("IDEM_WAIT_CLIENT_OF"); url != "" {
		waitClientProcess(t, url)
		return
	}
	n, _ := strconv.Atoi(os.Getenv("IDEM_WAIT_PROCESSES"))
	if n <= 0 {
		t.Skip("set IDEM_WAIT_PROCESSES=N to run N waiters from a second process")
	}
	s := memstore.New(nil)
	t.Cleanup(func() { _ = s.Close() })
	key := waittest.Key(t)
	joins := idem.WaitJoins(key)
	g := waittest.NewGated()
	srv := waittest.Server(t, s, idem.Config{InFlightWait: 5 * time.Minute, InFlightMaxWaiters: n, InFlightMaxWaitersPerKey: n}, g)
	defer g.Open()
	go waittest.Post(context.Background(), waittest.Client(), srv.URL, key, nil)
	<-g.Entered
	var base runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&base)
	cmd := exec.Command(os.Args[0], "-test.run=^TestInFlightWaitManyWaitersTwoProcesses$", "-test.v")
	cmd.Env = append(os.Environ(), "IDEM_WAIT_CLIENT_OF="+srv.URL, "IDEM_WAIT_KEY="+key, "IDEM_WAIT_PROCESSES="+strconv.Itoa(n))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	for range n {
		<-joins
	}
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	t.Logf("%d waiters: server heap and stacks %.1f KiB per waiting request (net/http's connection included), %d goroutines",
		n, float64(ms.HeapInuse+ms.StackInuse-base.HeapInuse-base.StackInuse)/1024/float64(n), runtime.NumGoroutine())
	g.Open()
	if err := cmd.Wait(); err != nil {
		t.Fatalf("client process: %v\n%s", err, out.String())
	}
	t.Log(strings.TrimSpace(out.String()))
}

// waitClientProcess is the client half of
// TestInFlightWaitManyWaitersTwoProcesses: N requests with the key, each on a
// connection of its own; every one must be the replayed 201.
func waitClientProcess(t *testing.T, url string) {
	n, _ := strconv.Atoi(os.Getenv("IDEM_WAIT_PROCESSES"))
	key := os.Getenv("IDEM_WAIT_KEY")
	c := waittest.Client()
	var wg sync.WaitGroup
	var replayed, other atomic.Int64
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a := waittest.Post(context.Background(), c, url, key, nil)
			if a.Status == http.StatusCreated && a.Replayed {
				replayed.Add(1)
			} else {
				other.Add(1)
			}
		}()
	}
	wg.Wait()
	if other.Load() != 0 {
		t.Fatalf("%d replayed, %d other answers; want %d replays", replayed.Load(), other.Load(), n)
	}
	t.Logf("client: %d replayed, 0 other answers", replayed.Load())
}
