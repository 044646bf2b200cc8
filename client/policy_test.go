package client

import (
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
	"time"
)

func TestBackoffCeiling(t *testing.T) {
	t.Parallel()
	const base, capD = 100 * time.Millisecond, 10 * time.Second
	cases := []struct {
		n    int
		want time.Duration
	}{
		{-1, base}, {0, base}, {1, 200 * time.Millisecond}, {2, 400 * time.Millisecond},
		{6, 6400 * time.Millisecond}, {7, capD}, {40, capD}, {62, capD}, {63, capD}, {1000, capD},
	}
	for _, c := range cases {
		if got := backoffCeiling(base, capD, c.n); got != c.want {
			t.Errorf("backoffCeiling(%v, %v, %d) = %v, want %v", base, capD, c.n, got, c.want)
		}
	}
	// No overflow with a huge base: the cap wins.
	if got := backoffCeiling(time.Hour, 1<<62, 40); got != 1<<62 {
		t.Errorf("backoffCeiling(1h, 1<<62, 40) = %v, want the cap", got)
	}
}

// TestFullJitter checks that every wait lies in [0, min(cap, base·2^n)] and that
// the waits spread over the whole range (full jitter, not "equal jitter", which
// never goes below half the ceiling, nor a fixed delay).
func TestFullJitter(t *testing.T) {
	t.Parallel()
	tr := &Transport{MinBackoff: 10 * time.Millisecond, MaxBackoff: 500 * time.Millisecond, Rand: rand.NewPCG(1, 2)}
	s, err := tr.settings()
	if err != nil {
		t.Fatal(err)
	}
	for n := range 10 {
		ceil := backoffCeiling(s.minBackoff, s.maxBackoff, n)
		lo, hi := time.Duration(1<<62), time.Duration(-1)
		for range 2000 {
			d := tr.backoff(s, n)
			if d < 0 || d > ceil {
				t.Fatalf("retry %d: backoff %v outside [0, %v]", n, d, ceil)
			}
			lo, hi = min(lo, d), max(hi, d)
		}
		if lo > ceil/10 || hi < ceil*9/10 {
			t.Errorf("retry %d: 2000 waits spanned [%v, %v] of [0, %v]; full jitter covers the whole range", n, lo, hi, ceil)
		}
	}
}

// maxSource always returns the largest value: jitter must still stay in bounds.
type maxSource struct{}

func (maxSource) Uint64() uint64 { return 1<<64 - 1 }

func TestJitterExtremeSource(t *testing.T) {
	t.Parallel()
	tr := &Transport{Rand: maxSource{}}
	for _, ceil := range []time.Duration{0, 1, 7, time.Second, 1<<63 - 1} {
		if d := tr.jitter(ceil); d < 0 || d > ceil {
			t.Errorf("jitter(%v) = %v, outside [0, ceil]", ceil, d)
		}
	}
}

func TestParseRetryAfter(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	huge := time.Duration(1<<63 - 1)
	cases := []struct {
		in     string
		want   time.Duration
		wantOK bool
	}{
		{"", 0, false},
		{"0", 0, true},
		{"1", time.Second, true},
		{" 120 ", 120 * time.Second, true},
		{"99999999999999999999999", huge, true},
		{"9223372036", 9223372036 * time.Second, true},
		{"9223372037", huge, true},
		{"-1", 0, false},
		{"1.5", 0, false},
		{"soon", 0, false},
		{"Sun, 01 Mar 2026 12:01:30 GMT", 90 * time.Second, true}, // IMF-fixdate
		{"Sunday, 01-Mar-26 12:00:05 GMT", 5 * time.Second, true}, // RFC 850
		{"Sun Mar  1 12:00:42 2026", 42 * time.Second, true},      // asctime
		{"Sun, 01 Mar 2026 11:59:00 GMT", 0, true},                // in the past
		{"Sun, 01 Mar 2026 12:01:30 +0100", 0, false},             // not an HTTP-date
	}
	for _, c := range cases {
		got, ok := parseRetryAfter(c.in, now)
		if got != c.want || ok != c.wantOK {
			t.Errorf("parseRetryAfter(%q) = %v, %v; want %v, %v", c.in, got, ok, c.want, c.wantOK)
		}
	}
}

func TestInvalidTransport(t *testing.T) {
	t.Parallel()
	cases := map[string]*Transport{
		"MaxAttempts":    {MaxAttempts: -1},
		"MinBackoff":     {MinBackoff: -time.Second},
		"MaxBackoff":     {MinBackoff: time.Second, MaxBackoff: time.Millisecond},
		"MaxRetryAfter":  {MaxRetryAfter: -1},
		"AttemptTimeout": {AttemptTimeout: -1},
		"HeaderName":     {HeaderName: "Idempotency Key"},
	}
	for field, tr := range cases {
		req, _ := http.NewRequest(http.MethodPost, "http://127.0.0.1:1/", nil)
		_, err := tr.RoundTrip(req)
		if err == nil {
			t.Errorf("%s: RoundTrip accepted an invalid Transport", field)
			continue
		}
		if !strings.Contains(err.Error(), field) {
			t.Errorf("%s: error %q does not name the field", field, err)
		}
	}
	// A large MinBackoff alone raises the default cap instead of failing.
	if _, err := (&Transport{MinBackoff: time.Minute}).settings(); err != nil {
		t.Errorf("MinBackoff above the default MaxBackoff: %v", err)
	}
}
