package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"encoding/xml"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestPercentile(t *testing.T) {
	t.Parallel()
	var ls []time.Duration
	for i := 100; i >= 1; i-- {
		ls = append(ls, time.Duration(i)*time.Millisecond)
	}
	p50, p99, mean := latencyStats(ls)
	if p50 != 50*time.Millisecond || p99 != 99*time.Millisecond {
		t.Errorf("p50, p99 = %v, %v; want 50ms, 99ms", p50, p99)
	}
	if mean != 50500*time.Microsecond {
		t.Errorf("mean = %v; want 50.5ms", mean)
	}
	if p, q, m := latencyStats(nil); p != 0 || q != 0 || m != 0 {
		t.Errorf("empty: %v %v %v; want zeros", p, q, m)
	}
}

func TestKeys(t *testing.T) {
	t.Parallel()
	g := &keyGen{runID: "0123abcd"}
	seen := map[string]bool{}
	fresh, distinct := g.keys(keysFresh, nil)
	for i := int64(0); i < 1000; i++ {
		k := fresh(i)
		if len(k) != 36 {
			t.Fatalf("key %q has %d characters; Fiber's default check wants 36", k, len(k))
		}
		if seen[k] {
			t.Fatalf("fresh key %q repeated", k)
		}
		seen[k] = true
	}
	if distinct(1000) != 1000 {
		t.Errorf("fresh distinct(1000) = %d", distinct(1000))
	}
	hot1, hd := g.keys(keysHot, nil)
	hot2, _ := g.keys(keysHot, nil)
	if hot1(0) != hot1(HotKeyEvery-1) || hot1(0) == hot1(HotKeyEvery) {
		t.Errorf("a hot key must last exactly %d requests", HotKeyEvery)
	}
	if hot1(0) == hot2(0) || seen[hot1(0)] {
		t.Error("each slice of the hot-key case needs keys of its own")
	}
	if hd(HotKeyEvery+1) != 2 {
		t.Errorf("hot distinct(%d) = %d; want 2", HotKeyEvery+1, hd(HotKeyEvery+1))
	}
	pool := []string{"a", "b", "c"}
	pk, pd := g.keys(keysPool, pool)
	if pk(0) != "a" || pk(4) != "b" || pd(10) != 3 {
		t.Error("pool keys must cycle through the pool")
	}
	for _, tag := range []uint16{tagPool, tagFresh, tagHot} {
		if got, ok := keyTag(g.key(tag, 7)); !ok || got != tag {
			t.Errorf("keyTag(key(%#x, 7)) = %#x, %v; want the tag back", tag, got, ok)
		}
	}
	for _, k := range []string{"", "a", "0123abcd-zzzz-0123-abcd-000000000001", "client-chosen-key"} {
		if _, ok := keyTag(k); ok {
			t.Errorf("keyTag(%q) found a tag in a key keyGen did not make", k)
		}
	}
}

// TestCheckCatchesDoubleExecution runs the replay and hot-key cases against a
// "middleware" that executes every request: the consistency checks must fail.
func TestCheckCatchesDoubleExecution(t *testing.T) {
	t.Parallel()
	tg := &target{name: "broken", backend: newMemBackend(), replayHeader: true}
	mux := http.NewServeMux()
	h := ordersHandler(tg.backend)
	mux.Handle("POST /bare/orders", h)
	mux.Handle("POST /idem/orders", h) // no idempotency at all
	mux.Handle("GET "+statsPath, statsHandler(tg))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mux}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	tg.url = "http://" + ln.Addr().String()
	tg.variants = []variant{
		{VariantBaseline, "/bare/orders", keysNone},
		{VariantFirst, "/idem/orders", keysFresh},
		{VariantReplay, "/idem/orders", keysPool},
		{VariantHot, "/idem/orders", keysHot},
	}
	cfg := &Config{Duration: 150 * time.Millisecond, Rounds: 1, Concurrency: []int{2}, ReplayKeys: 4}
	cfg.defaults()
	res, err := runTarget(context.Background(), tg, cfg, "deadbeef")
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res {
		failed := r.Check != ""
		want := r.Variant == VariantReplay || r.Variant == VariantHot
		if failed != want {
			t.Errorf("%s: check %q; want failed=%v", r.Variant, r.Check, want)
		}
		if r.Variant == VariantReplay && r.Rows == 0 {
			t.Error("replay case against a handler without idem inserted no rows; rows are not counted")
		}
	}
}

func TestResultCheck(t *testing.T) {
	t.Parallel()
	tg := &target{name: "x", replayHeader: true}
	lat := []time.Duration{time.Millisecond, time.Millisecond}
	cases := []struct {
		v    variant
		acc  cellAcc
		fail string
	}{
		{variant{VariantBaseline, "", keysNone}, cellAcc{s: sample{latencies: lat, executed: 2}, rows: 2}, ""},
		{variant{VariantBaseline, "", keysNone}, cellAcc{s: sample{latencies: lat, executed: 2}, rows: 1}, "1 rows were inserted for 2 executed"},
		{variant{VariantFirst, "", keysFresh}, cellAcc{s: sample{latencies: lat, executed: 1, replayed: 1}, rows: 1, keys: 2}, "fresh keys got 1 replays"},
		{variant{VariantReplay, "", keysPool}, cellAcc{s: sample{latencies: lat, replayed: 2}, keys: 2}, ""},
		{variant{VariantReplay, "", keysPool}, cellAcc{s: sample{latencies: lat, executed: 1, replayed: 1}, rows: 1, keys: 2}, "replays of completed keys executed"},
		{variant{VariantHot, "", keysHot}, cellAcc{s: sample{latencies: lat, executed: 2}, rows: 2, keys: 1}, "2 executions for 1 distinct keys"},
		{variant{VariantFirst, "", keysFresh}, cellAcc{s: sample{latencies: lat, executed: 1, other: 1}, rows: 1, keys: 2}, "1 answers were errors"},
		{variant{VariantFirst, "", keysFresh}, cellAcc{}, "no request was answered"},
	}
	for _, c := range cases {
		c.acc.s.elapsed = time.Second
		r := result(tg, c.v, 1, &c.acc)
		if c.fail == "" && r.Check != "" || c.fail != "" && !strings.Contains(r.Check, c.fail) {
			t.Errorf("%s %+v: check %q; want %q", c.v.name, c.acc, r.Check, c.fail)
		}
	}
}

func TestOutputs(t *testing.T) {
	t.Parallel()
	rep := &Report{
		Duration: "1s", Rounds: 1, Machine: Machine{CPUs: 2},
		Results: []Result{
			{Target: "postgres", Variant: VariantBaseline, Concurrency: 1, Throughput: 1000, Ratio: 1, MeanMicros: 1000, Status: map[string]int64{"201": 1000}},
			{Target: "postgres", Variant: VariantFirst, Concurrency: 1, Throughput: 600, Ratio: 0.6, P99Micros: 3000, Status: map[string]int64{"201": 600}},
			{Target: "postgres", Variant: VariantReplay, Concurrency: 1, Throughput: 1200, Ratio: 1.2, Status: map[string]int64{"201 replayed": 1200}},
			{Target: "fiber", Variant: VariantFirst, Concurrency: 1, Throughput: 900, Check: "1 rows were inserted for 2 executed requests"},
		},
		Growth: &GrowthReport{RefRecords: 10_000, Steps: []GrowthStep{{Records: 10_000, P99Micros: 100, RefP99Micros: 100}, {Records: 10_000_000, P99Micros: 140, RefP99Micros: 100}}},
	}
	rep.Goals = goals(rep)
	want := map[string]string{
		"PostgreSQL first-time throughput":           "no",
		"PostgreSQL replay vs first-time throughput": "yes",
		"PostgreSQL claim p99, largest table vs the reference table (smallest size), timed in the same window": "yes",
	}
	for _, g := range rep.Goals {
		if w, ok := want[g.Name]; ok && g.Met != w {
			t.Errorf("goal %q: met %q (%s); want %q", g.Name, g.Met, g.Measured, w)
		}
	}
	if !rep.Failed() {
		t.Error("Failed() = false with a failed check")
	}
	var md bytes.Buffer
	if err := rep.WriteMarkdown(&md); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"| postgres | first | 1 | 600 | 0.60 |", "201r:1200", "**FAIL: 1 rows", "| 10M |"} {
		if !strings.Contains(md.String(), s) {
			t.Errorf("markdown lacks %q:\n%s", s, md.String())
		}
	}
	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(js.Bytes(), &back); err != nil || len(back.Results) != 4 {
		t.Fatalf("JSON does not read back: %v", err)
	}
	var svg bytes.Buffer
	if err := rep.WriteSVG(&svg); err != nil {
		t.Fatal(err)
	}
	if err := wellFormed(&svg); err != nil {
		t.Fatalf("SVG is not well-formed XML: %v", err)
	}
}

// wellFormed reads r as XML to the end.
func wellFormed(r io.Reader) error {
	d := xml.NewDecoder(r)
	for {
		if _, err := d.Token(); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
	}
}
