package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/valyala/fasthttp"
)

// LoadEnv is the environment variable that carries a LoadSpec (JSON) to a
// loader process started by RunOverhead; the command it runs
// (OverheadConfig.LoaderCommand) must hand it to Load.
const LoadEnv = "IDEM_BENCH_LOAD"

// LoadSpec is what one loader process does: complete ReplayKeys keys first
// when Keys is "pool", warm up for Warmup, then run Clients closed-loop
// keep-alive fasthttp clients against URL for Duration, and read the server's
// counters around the measured window only.
type LoadSpec struct {
	// URL is the endpoint, such as http://127.0.0.1:PORT/idem/orders; its
	// server's /_bench/stats gives rows, allocations and peak RSS.
	URL string `json:"url"`
	// Keys is "none" (no Idempotency-Key), "fresh" (a new key per request) or
	// "pool" (cycling through ReplayKeys keys completed before the warm-up).
	Keys       string        `json:"keys"`
	Clients    int           `json:"clients"`
	Duration   time.Duration `json:"duration"`
	Warmup     time.Duration `json:"warmup"`
	ReplayKeys int           `json:"replay_keys"`
	// ServerPID is the server process whose CPU is read from /proc before and
	// after the measured window (0: not read).
	ServerPID int `json:"server_pid"`
	// RunID (8 hex digits) makes the keys unique to the run.
	RunID string `json:"run_id"`
}

// LoadResult is what a loader process measured in its window.
type LoadResult struct {
	Requests   int64            `json:"requests"`
	Seconds    float64          `json:"seconds"`
	Status     map[string]int64 `json:"status"`
	Executed   int64            `json:"executed"` // 2xx answers without Idempotent-Replayed
	Replayed   int64            `json:"replayed"` // answers with Idempotent-Replayed: true
	Other      int64            `json:"other"`    // errors and other statuses
	P50Micros  float64          `json:"p50_us"`
	P99Micros  float64          `json:"p99_us"`
	MeanMicros float64          `json:"mean_us"`
	// ServerCPUNanos is the server's user + system CPU over the window, summed
	// over its threads from /proc/<pid>/task/*/schedstat (ns; the same time
	// as utime + stime of /proc/<pid>/stat without its 10 ms ticks);
	// ServerTickNanos the same from /proc/<pid>/stat, for comparison.
	ServerCPUNanos  int64 `json:"server_cpu_ns"`
	ServerTickNanos int64 `json:"server_stat_cpu_ns"`
	// LoaderCPUNanos is this process's CPU over the window.
	LoaderCPUNanos int64 `json:"loader_cpu_ns"`
	// Rows, Mallocs and AllocBytes are the server's counters' differences over
	// the window; PeakRSSKiB its VmHWM after it, HeapLiveBytes its live heap
	// after a GC (taken after the window).
	Rows          int64  `json:"rows"`
	Mallocs       uint64 `json:"mallocs"`
	AllocBytes    uint64 `json:"alloc_bytes"`
	PeakRSSKiB    int64  `json:"peak_rss_kib"`
	HeapLiveBytes uint64 `json:"heap_live_bytes"`
}

// Load is the loader process of an overhead run (idem bench load): it runs
// spec (the JSON of LoadEnv) and prints one LoadResult as JSON on stdout.
func Load(ctx context.Context, spec string, stdout io.Writer) error {
	var sp LoadSpec
	if err := json.Unmarshal([]byte(spec), &sp); err != nil {
		return fmt.Errorf("%s does not hold a load spec (%v); idem bench --overhead sets it when it starts a loader", LoadEnv, err)
	}
	res, err := load(ctx, sp)
	if err != nil {
		return err
	}
	return json.NewEncoder(stdout).Encode(res)
}

func load(ctx context.Context, sp LoadSpec) (*LoadResult, error) {
	u, err := url.Parse(sp.URL)
	if err != nil || u.Host == "" {
		return nil, fmt.Errorf("load: bad URL %q", sp.URL)
	}
	if sp.Clients < 1 || sp.Duration <= 0 {
		return nil, errors.New("load: want at least one client and a positive duration")
	}
	if len(sp.RunID) != 8 {
		sp.RunID = randomHex(4)
	}
	hc := &fasthttp.HostClient{
		Addr: u.Host, MaxConns: max(sp.Clients, 8) + 2, MaxConnWaitTimeout: 30 * time.Second, ReadTimeout: 30 * time.Second, WriteTimeout: 30 * time.Second,
		MaxIdleConnDuration: time.Minute,
	}
	defer hc.CloseIdleConnections()
	statsURL := "http://" + u.Host + statsPath
	kg := &keyGen{runID: sp.RunID}
	var keys keyFunc
	switch sp.Keys {
	case "none", "":
	case "fresh":
		keys, _ = kg.keys(keysFresh, nil)
	case "pool":
		n := max(sp.ReplayKeys, 1)
		pool := make([]string, n)
		for i := range pool {
			pool[i] = kg.key(tagPool, int64(i))
		}
		// Complete the pool once, unmeasured; every answer must be an execution.
		var next atomic.Int64
		s := fastLoop(ctx, hc, sp.URL, func(i int64) string { return pool[i] }, min(8, n), time.Hour, int64(n), &next)
		if s.executed != int64(n) {
			return nil, fmt.Errorf("load: completing %d replay keys: %d executed (answers %v)", n, s.executed, s.status)
		}
		keys, _ = kg.keys(keysPool, pool)
	default:
		return nil, fmt.Errorf("load: --keys %q; use none, fresh or pool", sp.Keys)
	}
	var next atomic.Int64
	if sp.Warmup > 0 {
		fastLoop(ctx, hc, sp.URL, keys, sp.Clients, sp.Warmup, 0, &next)
	}
	before, err := fastStats(hc, statsURL, false)
	if err != nil {
		return nil, err
	}
	cpu0, tick0, self0 := taskCPU(sp.ServerPID), procCPU(sp.ServerPID), selfCPU()
	s := fastLoop(ctx, hc, sp.URL, keys, sp.Clients, sp.Duration, 0, &next)
	cpu1, tick1, self1 := taskCPU(sp.ServerPID), procCPU(sp.ServerPID), selfCPU()
	after, err := fastStats(hc, statsURL, true)
	if err != nil {
		return nil, err
	}
	p50, p99, mean := latencyStats(s.latencies)
	res := &LoadResult{
		Requests: int64(len(s.latencies)), Seconds: s.elapsed.Seconds(), Status: s.status,
		Executed: s.executed, Replayed: s.replayed, Other: s.other + s.inFlight,
		P50Micros: micros(p50), P99Micros: micros(p99), MeanMicros: micros(mean),
		ServerCPUNanos: -1, ServerTickNanos: -1, LoaderCPUNanos: self1 - self0,
		Rows: after.Rows - before.Rows, Mallocs: after.Mallocs - before.Mallocs, AllocBytes: after.AllocBytes - before.AllocBytes,
		PeakRSSKiB: after.PeakRSSKiB, HeapLiveBytes: after.HeapLive,
	}
	if sp.ServerPID > 0 && cpu0 >= 0 && cpu1 >= 0 {
		res.ServerCPUNanos = cpu1 - cpu0
	}
	if sp.ServerPID > 0 && tick0 >= 0 && tick1 >= 0 {
		res.ServerTickNanos = tick1 - tick0
	}
	return res, nil
}

// fastLoop is closedLoop with fasthttp clients: conc workers, each with its
// own kept-alive connection and its request and response reused, sending the
// next request when the previous one was answered, for d or limit requests.
// next numbers the requests (shared with earlier loops, so that keys do not
// repeat).
func fastLoop(ctx context.Context, hc *fasthttp.HostClient, url string, keys keyFunc, conc int, d time.Duration, limit int64, next *atomic.Int64) *sample {
	results := make([]*sample, conc)
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	var stop atomic.Bool
	if limit == 0 {
		t := time.AfterFunc(d, func() { stop.Store(true) })
		defer t.Stop()
	}
	base := next.Load()
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			s := &sample{status: map[string]int64{}, latencies: make([]time.Duration, 0, 4096)}
			results[w] = s
			req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
			defer fasthttp.ReleaseRequest(req)
			defer fasthttp.ReleaseResponse(resp)
			req.SetRequestURI(url)
			req.Header.SetMethod(fasthttp.MethodPost)
			req.Header.SetContentType("application/json")
			req.SetBodyRaw(orderBody)
			for ctx.Err() == nil && !stop.Load() {
				i := next.Add(1) - 1
				if limit > 0 && i-base >= limit {
					return
				}
				if limit > 0 && time.Now().After(deadline) {
					return
				}
				if keys != nil {
					req.Header.Set("Idempotency-Key", keys(i-base))
				}
				t0 := time.Now()
				err := hc.Do(req, resp)
				s.latencies = append(s.latencies, time.Since(t0))
				status := resp.StatusCode()
				replayed := string(resp.Header.Peek("Idempotent-Replayed")) == "true"
				switch {
				case err != nil:
					s.status["error"]++
					s.other++
				case replayed:
					s.status[strconv.Itoa(status)+" replayed"]++
					s.replayed++
				case status >= 200 && status < 300:
					s.status[strconv.Itoa(status)]++
					s.executed++
				case status == 409:
					s.status["409"]++
					s.inFlight++
				default:
					s.status[strconv.Itoa(status)]++
					s.other++
				}
				resp.Reset()
			}
		}(w)
	}
	wg.Wait()
	total := &sample{status: map[string]int64{}}
	for _, r := range results {
		total.merge(r)
	}
	total.elapsed = time.Since(start)
	return total
}

// fastStats reads the server's counters (statsPath) with the loader's client.
func fastStats(hc *fasthttp.HostClient, url string, gc bool) (serverStats, error) {
	var s serverStats
	if gc {
		url += "?gc=1"
	}
	req, resp := fasthttp.AcquireRequest(), fasthttp.AcquireResponse()
	defer fasthttp.ReleaseRequest(req)
	defer fasthttp.ReleaseResponse(resp)
	req.SetRequestURI(url)
	if err := hc.Do(req, resp); err != nil {
		return s, fmt.Errorf("server stats: %w", err)
	}
	if resp.StatusCode() != 200 {
		return s, fmt.Errorf("server stats: status %d: %s", resp.StatusCode(), strings.TrimSpace(string(resp.Body())))
	}
	return s, json.Unmarshal(resp.Body(), &s)
}

// taskCPU returns the CPU time of process pid summed over its threads, from
// /proc/<pid>/task/*/schedstat, in ns; -1 when it cannot be read. The server
// processes measured (Go binaries) do not end threads while they run, so the
// sum is the process's CPU time.
func taskCPU(pid int) int64 {
	if pid <= 0 {
		return -1
	}
	dir := "/proc/" + strconv.Itoa(pid) + "/task"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return -1
	}
	var sum int64
	for _, e := range ents {
		b, err := os.ReadFile(dir + "/" + e.Name() + "/schedstat")
		if err != nil {
			continue // the thread ended
		}
		f := strings.Fields(string(b))
		if len(f) == 0 {
			return -1
		}
		ns, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return -1
		}
		sum += ns
	}
	return sum
}
