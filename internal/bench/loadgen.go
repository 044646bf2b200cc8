package bench

import (
	"bytes"
	"context"
	"io"
	"net"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// orderBody is the request body every benchmark request sends. It is the same for
// every request, so that replays and hot-key duplicates match the fingerprint.
var orderBody = []byte(`{"item":"widget","qty":1}`)

// keyFunc returns the Idempotency-Key for request i (counted over all workers of
// a cell); "" sends no key.
type keyFunc func(i int64) string

// sample is what one cell slice measured.
type sample struct {
	latencies []time.Duration
	elapsed   time.Duration
	status    map[string]int64 // "201", "201 replayed", "409", …, "error"
	executed  int64            // 2xx answers without Idempotent-Replayed
	replayed  int64            // answers with Idempotent-Replayed: true
	inFlight  int64            // 409 answers
	other     int64            // anything else, transport errors included
}

func (s *sample) merge(o *sample) {
	s.latencies = append(s.latencies, o.latencies...)
	s.elapsed += o.elapsed
	if s.status == nil {
		s.status = map[string]int64{}
	}
	for k, v := range o.status {
		s.status[k] += v
	}
	s.executed += o.executed
	s.replayed += o.replayed
	s.inFlight += o.inFlight
	s.other += o.other
}

// newClient returns an HTTP client with enough idle connections for conc
// workers, so that every worker keeps its own kept-alive connection.
func newClient(conc int) *http.Client {
	return &http.Client{
		Transport: &http.Transport{
			DialContext:         (&net.Dialer{Timeout: 5 * time.Second}).DialContext,
			MaxIdleConns:        conc * 2,
			MaxIdleConnsPerHost: conc * 2,
			MaxConnsPerHost:     0,
			IdleConnTimeout:     time.Minute,
			DisableCompression:  true,
		},
		Timeout: 30 * time.Second,
	}
}

// closedLoop runs conc workers against url for d. Each worker is one client: it
// sends the next request only when the previous one was answered (a closed loop),
// so conc is the number of requests in flight at any time. Requests in flight
// when d ends are finished and counted; none is cut short. With limit > 0 the
// loop also stops after limit requests.
func closedLoop(ctx context.Context, client *http.Client, url string, keys keyFunc, conc int, d time.Duration, limit int64) *sample {
	var next atomic.Int64
	results := make([]*sample, conc)
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	for w := 0; w < conc; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			s := &sample{status: map[string]int64{}, latencies: make([]time.Duration, 0, 1024)}
			results[w] = s
			for ctx.Err() == nil && time.Now().Before(deadline) {
				i := next.Add(1) - 1
				if limit > 0 && i >= limit {
					return
				}
				key := ""
				if keys != nil {
					key = keys(i)
				}
				t0 := time.Now()
				status, replayed, err := send(ctx, client, url, key)
				s.latencies = append(s.latencies, time.Since(t0))
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
				case status == http.StatusConflict:
					s.status["409"]++
					s.inFlight++
				default:
					s.status[strconv.Itoa(status)]++
					s.other++
				}
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

// send sends one order request and reads the whole answer.
func send(ctx context.Context, client *http.Client, url, key string) (status int, replayed bool, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(orderBody))
	if err != nil {
		return 0, false, err
	}
	req.Header.Set("Content-Type", "application/json")
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, false, err
	}
	_, err = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed") == "true", err
}

// percentile returns the p-th percentile (0 < p <= 1) of sorted latencies, by the
// nearest-rank method.
func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	rank := int(p*float64(len(sorted))+0.999999) - 1
	if rank < 0 {
		rank = 0
	}
	if rank >= len(sorted) {
		rank = len(sorted) - 1
	}
	return sorted[rank]
}

// latencyStats sorts ls and returns its p50, p99 and mean.
func latencyStats(ls []time.Duration) (p50, p99, mean time.Duration) {
	if len(ls) == 0 {
		return 0, 0, 0
	}
	sort.Slice(ls, func(i, j int) bool { return ls[i] < ls[j] })
	var sum time.Duration
	for _, l := range ls {
		sum += l
	}
	return percentile(ls, 0.50), percentile(ls, 0.99), sum / time.Duration(len(ls))
}
