package unixnano_test

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/unixnano"
)

func TestOfSaturates(t *testing.T) {
	now := time.Now()
	cases := []struct {
		t    time.Time
		want int64
	}{
		{now, now.UnixNano()},
		{time.Unix(0, 0), 0},
		{time.Unix(0, math.MaxInt64), math.MaxInt64},
		{time.Unix(0, math.MinInt64), math.MinInt64},
		{now.Add(math.MaxInt64), math.MaxInt64}, // the longest TTL
		{time.Unix(0, math.MaxInt64).Add(time.Nanosecond), math.MaxInt64},
		{time.Unix(0, math.MinInt64).Add(-time.Nanosecond), math.MinInt64},
		{time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC), math.MaxInt64},
		{time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC), math.MinInt64},
		// Either side of the seconds that Of converts without comparing.
		{time.Unix(9223372035, 999999999), 9223372035999999999},
		{time.Unix(9223372036, 0), 9223372036000000000},
		{time.Unix(9223372036, 854775808), math.MaxInt64},
		{time.Unix(-9223372035, 0), -9223372035000000000},
		{time.Unix(-9223372036, 0), -9223372036000000000},
		{time.Unix(-9223372037, 0), math.MinInt64},
	}
	for _, c := range cases {
		if got := unixnano.Of(c.t); got != c.want {
			t.Errorf("Of(%v) = %d, want %d", c.t, got, c.want)
		}
	}
}

func ExampleOf() {
	far := time.Date(2262, 4, 12, 0, 0, 0, 0, time.UTC) // just past int64 nanoseconds
	fmt.Println(far.UnixNano() < 0, unixnano.Of(far) == math.MaxInt64)
	// Output: true true
}
