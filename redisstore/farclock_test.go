package redisstore_test

import (
	"context"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestFarClock: a middleware clock decades before 1970 or centuries ahead
// (a NowFunc for a simulation, a broken RTC) still keeps each record for
// ExpiresAt − Now of Redis's time, and Get under that clock sees it, through
// claim, a second claim, Extend and Complete.
func TestFarClock(t *testing.T) {
	t.Parallel()
	for _, years := range []int{-100, 300, 5000} {
		t.Run(time.Now().AddDate(years, 0, 0).Format("2006"), func(t *testing.T) {
			t.Parallel()
			tb := setup(t)
			ctx := context.Background()
			const ttl, lease = time.Minute, 30 * time.Second
			clock := func() time.Time { return time.Now().AddDate(years, 0, 0) }
			now := clock()
			req := idem.ClaimRequest{
				Scope: "s", Key: "k", Fingerprint: "v1:far", Token: "tok-" + randomHex(8),
				Now: now, LeaseUntil: now.Add(lease), ExpiresAt: now.Add(ttl),
			}
			if _, claimed, err := tb.store.Claim(ctx, req); err != nil || !claimed {
				t.Fatalf("Claim = %v, %v", claimed, err)
			}
			rk := recordKeyOf(tb.prefix, "s", "k")
			wantPTTL(t, tb, rk, ttl-5*time.Second, ttl, "after Claim")
			if rec, err := tb.store.Get(ctx, "s", "k", now); err != nil || rec.State != idem.StateInFlight || !rec.LeaseUntil.Equal(req.LeaseUntil.Truncate(time.Millisecond)) || !rec.CreatedAt.Equal(now.Truncate(time.Millisecond)) {
				t.Fatalf("Get after Claim = %+v, %v; want the in-flight record with its times", rec, err)
			}
			other := req
			other.Token = "tok-" + randomHex(8)
			if rec, claimed, err := tb.store.Claim(ctx, other); err != nil || claimed || rec.Token != req.Token {
				t.Fatalf("second Claim = %+v, %v, %v; want the live claim to win", rec, claimed, err)
			}
			now = clock()
			if err := tb.store.Extend(ctx, "s", "k", req.Token, now, now.Add(lease)); err != nil {
				t.Fatalf("Extend: %v", err)
			}
			now = clock()
			if err := tb.store.Complete(ctx, "s", "k", req.Token, &idem.Response{Status: 201, Body: []byte("ok")}, now, now.Add(ttl)); err != nil {
				t.Fatalf("Complete: %v", err)
			}
			wantPTTL(t, tb, rk, ttl-5*time.Second, ttl, "after Complete")
			if rec, err := tb.store.Get(ctx, "s", "k", clock()); err != nil || rec.State != idem.StateComplete || rec.Response.Status != 201 {
				t.Fatalf("Get after Complete = %+v, %v; want the complete record", rec, err)
			}
			if rec, err := tb.store.Get(ctx, "s", "k", clock().Add(ttl)); err != idem.ErrNotFound {
				t.Fatalf("Get a TTL later = %+v, %v; want ErrNotFound", rec, err)
			}
		})
	}
}
