// Package unixnano converts times to Unix nanoseconds for stores that keep
// them as int64, without the wrap-around of time.Time.UnixNano.
package unixnano

import (
	"math"
	"time"
)

var maxTime, minTime = time.Unix(0, math.MaxInt64), time.Unix(0, math.MinInt64)

// Of returns t in Unix nanoseconds, saturated at the ends of int64 (the years
// 1677 and 2262): a TTL of centuries must keep its record, not wrap around
// into the past and expire it at once.
func Of(t time.Time) int64 {
	// Every time within a second of neither end converts as it is, without
	// the two comparisons below.
	if s := t.Unix(); s > math.MinInt64/int64(time.Second) && s < math.MaxInt64/int64(time.Second) {
		return t.UnixNano()
	}
	switch {
	case t.After(maxTime):
		return math.MaxInt64
	case t.Before(minTime):
		return math.MinInt64
	}
	return t.UnixNano()
}
