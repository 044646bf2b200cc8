// Package storetest is the conformance suite every idem.Store must pass.
//
// A store package runs it against the real backend:
//
//	func TestConformance(t *testing.T) {
//		storetest.Run(t, func(t *testing.T) idem.Store {
//			return newIsolatedStore(t) // its own table, schema or key prefix
//		})
//	}
//
// newStore is called once per subtest and must return a store that shares no
// records with any other call (subtests run in parallel, and the janitor subtest
// deletes everything expired in its store). The suite uses the real clock with
// short leases and TTLs, so that stores whose backend expires records by itself
// (Redis) are tested as they run.
package storetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// SelfExpiring is implemented by stores whose backend deletes expired records by
// itself (DeleteExpired is a no-op that returns 0). The janitor subtest then checks
// only that expired records are gone and live ones remain.
type SelfExpiring interface {
	ExpiresRecordsItself() bool
}

// Run runs the conformance suite against stores made by newStore. For a store
// that implements idem.StepStore it includes the step cases (subtests
// "Steps/…", see RunSteps); for one that does not they are skipped.
func Run(t *testing.T, newStore func(t *testing.T) idem.Store) {
	t.Helper()
	tests := []struct {
		name string
		fn   func(t *testing.T, s idem.Store)
	}{
		{"ClaimAbsent", testClaimAbsent},
		{"ClaimRace", testClaimRace},
		{"ClaimWhileInFlight", testClaimWhileInFlight},
		{"CompleteAndReplay", testCompleteAndReplay},
		{"RoundTrip", testRoundTrip},
		{"StaleToken", testStaleToken},
		{"AbsentRecord", testAbsentRecord},
		{"Release", testRelease},
		{"Extend", testExtend},
		{"LapsedLeaseTakenOver", testLapsedTakeover},
		{"LapsedLeaseOtherFingerprint", testLapsedOtherFingerprint},
		{"TakeoverRace", testTakeoverRace},
		{"ExpiredReclaimed", testExpiredReclaimed},
		{"ScopeIsolation", testScopeIsolation},
		{"LongKeysDistinct", testLongKeysDistinct},
		{"TxComplete", testTxComplete},
		{"SingleTxLock", testSingleTxLock},
		{"Janitor", testJanitor},
		{"LiveLeasePastTTL", testLiveLeasePastTTL},
		{"LongestTTL", testLongestTTL},
		{"HeaderBytesExact", testHeaderBytesExact},
		{"ResponseCopied", testResponseCopied},
		{"HostileHeaders", testHostileHeaders},
		{"FieldBounds", testFieldBounds},
		{"ClockBehind", func(t *testing.T, s idem.Store) { testClockSkew(t, s, -2*time.Minute) }},
		{"ClockAhead", func(t *testing.T, s idem.Store) { testClockSkew(t, s, 2*time.Minute) }},
		{"Linearizable", testLinearizable},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newStore(t)
			if s == nil {
				t.Fatal("newStore returned nil")
			}
			tc.fn(t, s)
		})
	}
	runStepsIn(t, newStore)
}

// Durations used by the suite. Leases are short so that lapses can be waited for;
// they are long enough for a store round trip on a loaded machine.
const (
	shortLease = 300 * time.Millisecond
	longTTL    = time.Hour
	timeSlack  = 2 * time.Millisecond // stores may keep times at millisecond precision
)

func randomID(t *testing.T) string {
	t.Helper()
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// fixture names the record a subtest works on.
type fixture struct {
	scope string
	key   string
}

func newFixture(t *testing.T) fixture {
	return fixture{scope: "tenant-" + randomID(t), key: "key-" + randomID(t)}
}

func (f fixture) claim(fp string, now time.Time, lease, ttl time.Duration) idem.ClaimRequest {
	return idem.ClaimRequest{
		Scope: f.scope, Key: f.key, Fingerprint: fp, Token: "tok-" + randToken(),
		Now: now, LeaseUntil: now.Add(lease), ExpiresAt: now.Add(ttl),
	}
}

func randToken() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func mustClaim(t *testing.T, s idem.Store, req idem.ClaimRequest) *idem.Record {
	t.Helper()
	rec, claimed, err := s.Claim(ctxFor(t), req)
	if err != nil {
		t.Fatalf("Claim(%q, %q): %v", req.Scope, req.Key, err)
	}
	if !claimed {
		t.Fatalf("Claim(%q, %q) = not claimed (record %+v), want claimed", req.Scope, req.Key, rec)
	}
	if rec == nil {
		t.Fatal("Claim returned claimed=true and a nil record")
	}
	return rec
}

func mustNotClaim(t *testing.T, s idem.Store, req idem.ClaimRequest) *idem.Record {
	t.Helper()
	rec, claimed, err := s.Claim(ctxFor(t), req)
	if err != nil {
		t.Fatalf("Claim(%q, %q): %v", req.Scope, req.Key, err)
	}
	if claimed {
		t.Fatalf("Claim(%q, %q) succeeded, want the existing record to win", req.Scope, req.Key)
	}
	if rec == nil {
		t.Fatal("Claim returned claimed=false and a nil record; it must return the existing record")
	}
	return rec
}

func mustGet(t *testing.T, s idem.Store, f fixture, now time.Time) *idem.Record {
	t.Helper()
	rec, err := s.Get(ctxFor(t), f.scope, f.key, now)
	if err != nil {
		t.Fatalf("Get(%q, %q): %v", f.scope, f.key, err)
	}
	return rec
}

func wantNotFound(t *testing.T, s idem.Store, f fixture, now time.Time) {
	t.Helper()
	rec, err := s.Get(ctxFor(t), f.scope, f.key, now)
	if !errors.Is(err, idem.ErrNotFound) {
		t.Fatalf("Get(%q, %q) = %+v, %v; want ErrNotFound", f.scope, f.key, rec, err)
	}
}

func wantLockLost(t *testing.T, what string, err error) {
	t.Helper()
	if !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("%s: err = %v, want ErrLockLost", what, err)
	}
}

func sameTime(a, b time.Time) bool {
	d := a.Sub(b)
	return d > -timeSlack && d < timeSlack
}

func checkInFlight(t *testing.T, rec *idem.Record, req idem.ClaimRequest) {
	t.Helper()
	if rec.Scope != req.Scope || rec.Key != req.Key {
		t.Errorf("record identity = (%q, %q), want (%q, %q)", rec.Scope, rec.Key, req.Scope, req.Key)
	}
	if rec.State != idem.StateInFlight {
		t.Errorf("State = %v, want in_flight", rec.State)
	}
	if rec.Token != req.Token {
		t.Errorf("Token = %q, want %q", rec.Token, req.Token)
	}
	if rec.Fingerprint != req.Fingerprint {
		t.Errorf("Fingerprint = %q, want %q", rec.Fingerprint, req.Fingerprint)
	}
	if !sameTime(rec.LeaseUntil, req.LeaseUntil) {
		t.Errorf("LeaseUntil = %v, want %v", rec.LeaseUntil, req.LeaseUntil)
	}
	if !sameTime(rec.ExpiresAt, req.ExpiresAt) {
		t.Errorf("ExpiresAt = %v, want %v", rec.ExpiresAt, req.ExpiresAt)
	}
	if rec.Response != nil {
		t.Errorf("Response = %+v on an in-flight record, want nil", rec.Response)
	}
}

func testClaimAbsent(t *testing.T, s idem.Store) {
	f := newFixture(t)
	now := time.Now()
	req := f.claim("v1:aaa", now, time.Minute, longTTL)
	rec := mustClaim(t, s, req)
	checkInFlight(t, rec, req)
	if !sameTime(rec.CreatedAt, now) {
		t.Errorf("CreatedAt = %v, want %v", rec.CreatedAt, now)
	}
	got := mustGet(t, s, f, now)
	checkInFlight(t, got, req)
}

func testClaimRace(t *testing.T, s idem.Store) {
	const n = 64
	f := newFixture(t)
	now := time.Now()
	start := make(chan struct{})
	type result struct {
		token   string
		rec     *idem.Record
		claimed bool
		err     error
	}
	results := make([]result, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := f.claim("v1:race", now, time.Minute, longTTL)
			<-start
			rec, claimed, err := s.Claim(context.Background(), req)
			results[i] = result{req.Token, rec, claimed, err}
		}()
	}
	close(start)
	wg.Wait()
	winners := 0
	var winner string
	for _, r := range results {
		if r.err != nil {
			t.Fatalf("concurrent Claim: %v", r.err)
		}
		if r.claimed {
			winners++
			winner = r.token
		}
	}
	if winners != 1 {
		t.Fatalf("%d of %d concurrent claims of one key succeeded, want exactly 1", winners, n)
	}
	for _, r := range results {
		if !r.claimed && (r.rec == nil || r.rec.Token != winner || r.rec.State != idem.StateInFlight) {
			t.Errorf("a losing claim returned %+v, want the winner's in-flight record (token %q)", r.rec, winner)
		}
	}
	if got := mustGet(t, s, f, now); got.Token != winner {
		t.Errorf("stored token = %q, want the winner's %q", got.Token, winner)
	}
}

func testClaimWhileInFlight(t *testing.T, s idem.Store) {
	f := newFixture(t)
	now := time.Now()
	first := f.claim("v1:one", now, time.Minute, longTTL)
	mustClaim(t, s, first)
	for _, fp := range []string{"v1:one", "v1:two"} {
		rec := mustNotClaim(t, s, f.claim(fp, now.Add(time.Second), time.Minute, longTTL))
		checkInFlight(t, rec, first)
	}
}

func testCompleteAndReplay(t *testing.T, s idem.Store) {
	f := newFixture(t)
	now := time.Now()
	req := f.claim("v1:done", now, time.Minute, longTTL)
	mustClaim(t, s, req)
	resp := &idem.Response{Status: 201, Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/orders/1"}}, Body: []byte(`{"id":1}`)}
	expires := now.Add(2 * longTTL)
	if err := s.Complete(ctxFor(t), f.scope, f.key, req.Token, resp, now, expires); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	for _, rec := range []*idem.Record{
		mustGet(t, s, f, now),
		mustNotClaim(t, s, f.claim("v1:done", now.Add(time.Second), time.Minute, longTTL)),
		mustNotClaim(t, s, f.claim("v1:other", now.Add(2*time.Minute), time.Minute, longTTL)), // past the old lease: a complete record is never taken over
		mustNotClaim(t, s, f.claim("v1:done", now.Add(2*time.Minute), time.Minute, longTTL)),  // not by its own request either
	} {
		if rec.State != idem.StateComplete {
			t.Fatalf("State = %v, want complete", rec.State)
		}
		if rec.Fingerprint != "v1:done" {
			t.Errorf("Fingerprint = %q, want v1:done", rec.Fingerprint)
		}
		if !sameTime(rec.ExpiresAt, expires) {
			t.Errorf("ExpiresAt = %v, want %v (the expiry passed to Complete)", rec.ExpiresAt, expires)
		}
		checkResponse(t, rec.Response, resp)
	}
	wantLockLost(t, "Complete of a complete record", s.Complete(ctxFor(t), f.scope, f.key, req.Token, resp, now, expires))
	wantLockLost(t, "Release of a complete record", s.Release(ctxFor(t), f.scope, f.key, req.Token))
	wantLockLost(t, "Extend of a complete record", s.Extend(ctxFor(t), f.scope, f.key, req.Token, now, now.Add(time.Hour)))
	if rec := mustGet(t, s, f, now); rec.State != idem.StateComplete {
		t.Fatalf("after rejected calls State = %v, want complete", rec.State)
	}
}

func checkResponse(t *testing.T, got, want *idem.Response) {
	t.Helper()
	if got == nil {
		t.Fatal("Response = nil on a complete record")
	}
	if got.Status != want.Status {
		t.Errorf("Status = %d, want %d", got.Status, want.Status)
	}
	if !bytes.Equal(got.Body, want.Body) {
		t.Errorf("Body differs: got %d bytes, want %d (first difference at %d)", len(got.Body), len(want.Body), firstDiff(got.Body, want.Body))
	}
	if got.BodyOmitted != want.BodyOmitted {
		t.Errorf("BodyOmitted = %v, want %v", got.BodyOmitted, want.BodyOmitted)
	}
	if got.Ref != want.Ref {
		t.Errorf("Ref = %q, want %q", got.Ref, want.Ref)
	}
	if len(got.Header) != len(want.Header) {
		t.Errorf("Header has %d names, want %d: %v", len(got.Header), len(want.Header), got.Header)
	}
	for k, wv := range want.Header {
		gv := got.Header[k]
		if strings.Join(gv, "\x00") != strings.Join(wv, "\x00") || len(gv) != len(wv) {
			t.Errorf("Header[%q] = %q, want %q", k, gv, wv)
		}
	}
}

func firstDiff(a, b []byte) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

func testRoundTrip(t *testing.T, s idem.Store) {
	allBytes := make([]byte, 256*4)
	for i := range allBytes {
		allBytes[i] = byte(i)
	}
	large := make([]byte, 1<<20)
	_, _ = rand.Read(large)
	cases := []struct {
		name string
		resp *idem.Response
	}{
		{"binary body", &idem.Response{Status: 200, Header: http.Header{"Content-Type": {"application/octet-stream"}}, Body: allBytes}},
		{"empty body", &idem.Response{Status: 204, Body: nil}},
		{"empty non-nil body", &idem.Response{Status: 200, Header: http.Header{"Content-Type": {"text/plain"}}, Body: []byte{}}},
		{"invalid utf-8 and nul", &idem.Response{Status: 500, Body: []byte("\xff\xfe\x00\x00tail\x00")}},
		{"large headers", &idem.Response{Status: 201, Header: http.Header{
			"Link":         {strings.Repeat("<https://example.com/x>; rel=next, ", 250), "<a>; rel=\"b\""},
			"Content-Type": {"application/json; charset=utf-8"},
			"Location":     {"/orders/ü-%C3%BC?q=\"x\""},
			"X-Empty":      {""},
		}, Body: []byte(`{}`)}},
		{"1 MiB random body", &idem.Response{Status: 200, Body: large}},
		{"reference only", &idem.Response{Status: 201, Header: http.Header{"Location": {"/orders/7"}}, BodyOmitted: true, Ref: "order:7\x00\xff"}},
		{"client error", &idem.Response{Status: 422, Header: http.Header{"Content-Type": {"application/problem+json"}}, Body: []byte(`{"status":422}`)}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t)
			now := time.Now()
			req := f.claim("v1:rt", now, time.Minute, longTTL)
			mustClaim(t, s, req)
			if err := s.Complete(ctxFor(t), f.scope, f.key, req.Token, tc.resp, now, now.Add(longTTL)); err != nil {
				t.Fatalf("Complete: %v", err)
			}
			checkResponse(t, mustGet(t, s, f, now).Response, tc.resp)
		})
	}
	t.Run("awkward scope and key", func(t *testing.T) {
		f := fixture{scope: "tenant:ü\x00/" + randomID(t) + strings.Repeat("s", 200), key: "{k}:*?[]\"\\" + randomID(t) + strings.Repeat("~", 200)}
		now := time.Now()
		req := f.claim("v1:awk", now, time.Minute, longTTL)
		checkInFlight(t, mustClaim(t, s, req), req)
		checkInFlight(t, mustGet(t, s, f, now), req)
	})
}

func testStaleToken(t *testing.T, s idem.Store) {
	f := newFixture(t)
	now := time.Now()
	req := f.claim("v1:stale", now, time.Minute, longTTL)
	mustClaim(t, s, req)
	ctx := ctxFor(t)
	resp := &idem.Response{Status: 200, Body: []byte("no")}
	wantLockLost(t, "Complete with a stale token", s.Complete(ctx, f.scope, f.key, "not-the-token", resp, now, now.Add(longTTL)))
	wantLockLost(t, "Release with a stale token", s.Release(ctx, f.scope, f.key, "not-the-token"))
	wantLockLost(t, "Extend with a stale token", s.Extend(ctx, f.scope, f.key, "not-the-token", now, now.Add(time.Hour)))
	checkInFlight(t, mustGet(t, s, f, now), req)
}

func testAbsentRecord(t *testing.T, s idem.Store) {
	f := newFixture(t)
	now := time.Now()
	ctx := ctxFor(t)
	wantNotFound(t, s, f, now)
	wantLockLost(t, "Complete of an absent record", s.Complete(ctx, f.scope, f.key, "tok", &idem.Response{Status: 200}, now, now.Add(longTTL)))
	wantLockLost(t, "Release of an absent record", s.Release(ctx, f.scope, f.key, "tok"))
	wantLockLost(t, "Extend of an absent record", s.Extend(ctx, f.scope, f.key, "tok", now, now.Add(time.Hour)))
	wantNotFound(t, s, f, now)
}

func testRelease(t *testing.T, s idem.Store) {
	f := newFixture(t)
	now := time.Now()
	req := f.claim("v1:rel", now, time.Minute, longTTL)
	mustClaim(t, s, req)
	if err := s.Release(ctxFor(t), f.scope, f.key, req.Token); err != nil {
		t.Fatalf("Release: %v", err)
	}
	wantNotFound(t, s, f, now)
	wantLockLost(t, "Complete after Release", s.Complete(ctxFor(t), f.scope, f.key, req.Token, &idem.Response{Status: 200}, now, now.Add(longTTL)))
	again := f.claim("v1:different", now, time.Minute, longTTL)
	checkInFlight(t, mustClaim(t, s, again), again)
}

func testExtend(t *testing.T, s idem.Store) {
	f := newFixture(t)
	now := time.Now()
	req := f.claim("v1:ext", now, shortLease, longTTL)
	mustClaim(t, s, req)
	newLease := now.Add(time.Minute)
	if err := s.Extend(ctxFor(t), f.scope, f.key, req.Token, now, newLease); err != nil {
		t.Fatalf("Extend: %v", err)
	}
	// Extending to the same deadline again still matches the record (a SQL store
	// must count matched rows, not changed ones).
	if err := s.Extend(ctxFor(t), f.scope, f.key, req.Token, now, newLease); err != nil {
		t.Fatalf("Extend to the same deadline twice: %v", err)
	}
	if rec := mustGet(t, s, f, now); !sameTime(rec.LeaseUntil, newLease) {
		t.Errorf("LeaseUntil after Extend = %v, want %v", rec.LeaseUntil, newLease)
	} else if !sameTime(rec.ExpiresAt, req.ExpiresAt) {
		// Extend raises an earlier expiry to the lease, and never lowers a later
		// one: a record cut short would count as absent once its holder died,
		// and the next request with another body would run instead of a 422.
		t.Errorf("ExpiresAt after Extend to %v = %v, want the claim's %v kept", newLease, rec.ExpiresAt, req.ExpiresAt)
	}
	time.Sleep(shortLease + 50*time.Millisecond) // the original lease has lapsed, the extended one has not
	rec := mustNotClaim(t, s, f.claim("v1:ext", time.Now(), time.Minute, longTTL))
	if rec.Token != req.Token {
		t.Errorf("extended claim was taken over: token %q, want %q", rec.Token, req.Token)
	}
	if err := s.Complete(ctxFor(t), f.scope, f.key, req.Token, &idem.Response{Status: 200}, now, time.Now().Add(longTTL)); err != nil {
		t.Fatalf("Complete after Extend: %v", err)
	}
}

func testLapsedTakeover(t *testing.T, s idem.Store) {
	f := newFixture(t)
	start := time.Now()
	first := f.claim("v1:lapse", start, shortLease, longTTL)
	mustClaim(t, s, first)
	time.Sleep(shortLease + 50*time.Millisecond)
	now := time.Now()
	second := f.claim("v1:lapse", now, time.Minute, longTTL)
	rec := mustClaim(t, s, second)
	checkInFlight(t, rec, second)
	if !sameTime(rec.CreatedAt, start) {
		t.Errorf("CreatedAt after takeover = %v, want the first claim's %v", rec.CreatedAt, start)
	}
	ctx := ctxFor(t)
	resp := &idem.Response{Status: 201, Body: []byte("first")}
	wantLockLost(t, "Complete by the holder whose lease lapsed", s.Complete(ctx, f.scope, f.key, first.Token, resp, now, now.Add(longTTL)))
	wantLockLost(t, "Extend by the holder whose lease lapsed", s.Extend(ctx, f.scope, f.key, first.Token, now, now.Add(time.Hour)))
	wantLockLost(t, "Release by the holder whose lease lapsed", s.Release(ctx, f.scope, f.key, first.Token))
	resp.Body = []byte("second")
	if err := s.Complete(ctx, f.scope, f.key, second.Token, resp, now, now.Add(longTTL)); err != nil {
		t.Fatalf("Complete by the taker: %v", err)
	}
	checkResponse(t, mustGet(t, s, f, now).Response, resp)
}

func testLapsedOtherFingerprint(t *testing.T, s idem.Store) {
	f := newFixture(t)
	first := f.claim("v1:mine", time.Now(), shortLease, longTTL)
	mustClaim(t, s, first)
	time.Sleep(shortLease + 50*time.Millisecond)
	rec := mustNotClaim(t, s, f.claim("v1:someone-else", time.Now(), time.Minute, longTTL))
	if rec.Token != first.Token || rec.Fingerprint != "v1:mine" {
		t.Errorf("a request with another fingerprint took over a lapsed claim: %+v", rec)
	}
}

func testTakeoverRace(t *testing.T, s idem.Store) {
	const n = 32
	f := newFixture(t)
	first := f.claim("v1:tr", time.Now(), shortLease, longTTL)
	mustClaim(t, s, first)
	time.Sleep(shortLease + 50*time.Millisecond)
	now := time.Now()
	start := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	winners := 0
	var errs []error
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := f.claim("v1:tr", now, time.Minute, longTTL)
			<-start
			_, claimed, err := s.Claim(context.Background(), req)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs = append(errs, err)
			}
			if claimed {
				winners++
			}
		}()
	}
	close(start)
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("concurrent takeover: %v", errors.Join(errs...))
	}
	if winners != 1 {
		t.Fatalf("%d of %d concurrent takeovers of one lapsed claim succeeded, want exactly 1", winners, n)
	}
}

func testExpiredReclaimed(t *testing.T, s idem.Store) {
	const ttl = 400 * time.Millisecond
	ctx := ctxFor(t)
	t.Run("complete", func(t *testing.T) {
		f := newFixture(t)
		now := time.Now()
		req := f.claim("v1:old", now, time.Minute, ttl)
		mustClaim(t, s, req)
		if err := s.Complete(ctx, f.scope, f.key, req.Token, &idem.Response{Status: 201, Body: []byte("old")}, now, now.Add(ttl)); err != nil {
			t.Fatalf("Complete: %v", err)
		}
		time.Sleep(ttl + 50*time.Millisecond)
		later := time.Now()
		wantNotFound(t, s, f, later)
		fresh := f.claim("v1:new", later, time.Minute, longTTL) // another fingerprint: an expired record counts as absent
		rec := mustClaim(t, s, fresh)
		checkInFlight(t, rec, fresh)
		if !sameTime(rec.CreatedAt, later) {
			t.Errorf("CreatedAt of a reclaimed record = %v, want %v (the expired record is replaced whole)", rec.CreatedAt, later)
		}
		wantLockLost(t, "Complete with the expired record's token", s.Complete(ctx, f.scope, f.key, req.Token, &idem.Response{Status: 200}, now, later.Add(longTTL)))
	})
	t.Run("in flight", func(t *testing.T) {
		f := newFixture(t)
		now := time.Now()
		req := f.claim("v1:old", now, ttl, ttl)
		mustClaim(t, s, req)
		time.Sleep(ttl + 50*time.Millisecond)
		later := time.Now()
		wantNotFound(t, s, f, later)
		fresh := f.claim("v1:new", later, time.Minute, longTTL)
		checkInFlight(t, mustClaim(t, s, fresh), fresh)
	})
}

func testScopeIsolation(t *testing.T, s idem.Store) {
	now := time.Now()
	id := randomID(t)
	// Pairs whose naive concatenation would collide.
	pairs := [][2]fixture{
		{{scope: "a-" + id, key: "k"}, {scope: "b-" + id, key: "k"}},
		{{scope: "a:" + id, key: "b:c"}, {scope: "a:" + id + ":b", key: "c"}},
		{{scope: "", key: id + "x"}, {scope: id, key: "x"}},
		{{scope: id + "}", key: "{k"}, {scope: id, key: "}{k"}},
		// Byte-exact comparison: no case folding, no trailing-space padding, no
		// Unicode normalisation.
		{{scope: id, key: "ABC"}, {scope: id, key: "abc"}},
		{{scope: id + " ", key: "k"}, {scope: id, key: "k"}},
		{{scope: id, key: "stra\u00dfe"}, {scope: id, key: "strasse"}},
		{{scope: id, key: "\u00e9"}, {scope: id, key: "e\u0301"}},
	}
	for _, p := range pairs {
		a, b := p[0], p[1]
		ra := a.claim("v1:a", now, time.Minute, longTTL)
		rb := b.claim("v1:b", now, time.Minute, longTTL)
		mustClaim(t, s, ra)
		mustClaim(t, s, rb)
		if err := s.Complete(ctxFor(t), a.scope, a.key, ra.Token, &idem.Response{Status: 201, Body: []byte("a")}, now, now.Add(longTTL)); err != nil {
			t.Fatalf("Complete in scope %q: %v", a.scope, err)
		}
		checkInFlight(t, mustGet(t, s, b, now), rb)
		wantLockLost(t, fmt.Sprintf("Complete of (%q, %q) with the token of (%q, %q)", b.scope, b.key, a.scope, a.key),
			s.Complete(ctxFor(t), b.scope, b.key, ra.Token, &idem.Response{Status: 200}, now, now.Add(longTTL)))
		if got := mustGet(t, s, a, now); got.State != idem.StateComplete || string(got.Response.Body) != "a" {
			t.Errorf("record (%q, %q) = %+v, want complete with body a", a.scope, a.key, got)
		}
	}
}

// testTxComplete: a TxStore's completion inside the business transaction is
// fenced as Store.Complete is — a stale token, or the token of a holder that
// was taken over, completes nothing (ErrLockLost from Tx.Complete or from
// Commit) — and commits only with the transaction: rolled back, the record
// stays in flight under its token.
func testTxComplete(t *testing.T, s idem.Store) {
	ts, ok := s.(idem.TxStore)
	if !ok {
		t.Skip("the store is not an idem.TxStore")
	}
	completeIn := func(f fixture, token string, resp *idem.Response, now time.Time, commit bool) error {
		ctx, tx, err := ts.BeginTx(ctxFor(t))
		if err != nil {
			t.Fatalf("BeginTx: %v", err)
		}
		defer func() { _ = tx.Rollback(ctxFor(t)) }()
		if err := tx.Complete(ctx, f.scope, f.key, token, resp, now, now.Add(longTTL)); err != nil {
			return err
		}
		if !commit {
			return tx.Rollback(ctx)
		}
		return tx.Commit(ctx)
	}
	resp := &idem.Response{Status: 201, Body: []byte("tx")}
	t.Run("stale token", func(t *testing.T) {
		f := newFixture(t)
		now := time.Now()
		req := f.claim("v1:tx", now, time.Minute, longTTL)
		mustClaim(t, s, req)
		wantLockLost(t, "Tx.Complete (and Commit) with a stale token", completeIn(f, "not-the-token", resp, now, true))
		checkInFlight(t, mustGet(t, s, f, now), req)
	})
	t.Run("rolled back", func(t *testing.T) {
		f := newFixture(t)
		now := time.Now()
		req := f.claim("v1:tx", now, time.Minute, longTTL)
		mustClaim(t, s, req)
		if err := completeIn(f, req.Token, resp, now, false); err != nil {
			t.Fatalf("Tx.Complete, then Rollback: %v", err)
		}
		checkInFlight(t, mustGet(t, s, f, now), req)
		if err := completeIn(f, req.Token, resp, now, true); err != nil {
			t.Fatalf("Tx.Complete and Commit after a rolled-back one: %v", err)
		}
		checkResponse(t, mustGet(t, s, f, now).Response, resp)
		wantLockLost(t, "a second Tx.Complete (and Commit) of a complete record", completeIn(f, req.Token, &idem.Response{Status: 500}, now, true))
		checkResponse(t, mustGet(t, s, f, now).Response, resp)
	})
	t.Run("taken over", func(t *testing.T) {
		f := newFixture(t)
		first := f.claim("v1:tx", time.Now(), shortLease, longTTL)
		mustClaim(t, s, first)
		time.Sleep(shortLease + 50*time.Millisecond)
		now := time.Now()
		taker := f.claim("v1:tx", now, time.Minute, longTTL)
		mustClaim(t, s, taker)
		wantLockLost(t, "Tx.Complete (and Commit) by the holder that was taken over", completeIn(f, first.Token, resp, now, true))
		checkInFlight(t, mustGet(t, s, f, now), taker)
	})
}

// testSingleTxLock: a SingleTxStore's BeginLocked is the in-flight signal of
// the single-transaction flow: while one transaction holds (scope, key), a
// second BeginLocked of it is ErrInFlight; Rollback and Commit free it; a
// record inserted and committed is the complete record every later call sees,
// and an expired record is replaced by Insert.
func testSingleTxLock(t *testing.T, s idem.Store) {
	ls, ok := s.(idem.SingleTxStore)
	if !ok {
		t.Skip("the store is not an idem.SingleTxStore")
	}
	f := newFixture(t)
	now := time.Now()
	begin := func(now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
		return ls.BeginLocked(ctxFor(t), f.scope, f.key, now)
	}
	_, tx, rec, err := begin(now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked of a fresh key = %+v, %v; want no record", rec, err)
	}
	if _, tx2, rec, err := begin(now); !errors.Is(err, idem.ErrInFlight) {
		if tx2 != nil {
			_ = tx2.Rollback(ctxFor(t))
		}
		_ = tx.Rollback(ctxFor(t))
		t.Fatalf("a second BeginLocked while the first holds the key = %+v, %v; want ErrInFlight", rec, err)
	}
	if err := tx.Rollback(ctxFor(t)); err != nil {
		t.Fatalf("Rollback: %v", err)
	}
	wantNotFound(t, s, f, now)
	insert := func(now, expires time.Time, body string) {
		t.Helper()
		ctx, tx, rec, err := begin(now)
		if err != nil || rec != nil {
			t.Fatalf("BeginLocked after a rollback or past the expiry = %+v, %v; want the key free and no live record", rec, err)
		}
		defer func() { _ = tx.Rollback(ctxFor(t)) }()
		err = tx.Insert(ctx, &idem.Record{Scope: f.scope, Key: f.key, State: idem.StateComplete, Fingerprint: "v1:single",
			Token: "tok-" + randToken(), CreatedAt: now, LeaseUntil: now, ExpiresAt: expires,
			Response: &idem.Response{Status: 201, Body: []byte(body)}})
		if err != nil {
			t.Fatalf("Insert: %v", err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatalf("Commit: %v", err)
		}
	}
	const ttl = 400 * time.Millisecond
	insert(now, now.Add(ttl), "first")
	if got := mustGet(t, s, f, now); got.State != idem.StateComplete || string(got.Response.Body) != "first" {
		t.Fatalf("after Insert and Commit the record is %+v, want complete with body first", got)
	}
	_, tx, rec, err = begin(now)
	if err != nil || rec == nil || rec.State != idem.StateComplete || rec.Response == nil || string(rec.Response.Body) != "first" {
		t.Fatalf("BeginLocked of a complete key = %+v, %v; want its complete record", rec, err)
	}
	_ = tx.Rollback(ctxFor(t))
	if rec, claimed, err := s.Claim(ctxFor(t), f.claim("v1:single", now, time.Minute, longTTL)); err != nil || claimed || rec.State != idem.StateComplete {
		t.Fatalf("Claim of a key inserted complete = %+v, %v, %v; want its complete record", rec, claimed, err)
	}
	time.Sleep(ttl + 50*time.Millisecond)
	later := time.Now()
	insert(later, later.Add(longTTL), "second")
	if got := mustGet(t, s, f, later); got.State != idem.StateComplete || string(got.Response.Body) != "second" {
		t.Fatalf("after an Insert over an expired record the record is %+v, want the new one", got)
	}
}

// testLongKeysDistinct: keys of the longest length the middleware passes
// (idem.DefaultMaxKeyLength bytes) and scopes of the longest stored length
// (idem.MaxStoredScopeLength bytes) that differ only in their last byte are
// different records, kept and returned whole: a store that indexes, hashes
// or locks a prefix of them would hand one client's outcome to another.
func testLongKeysDistinct(t *testing.T, s idem.Store) {
	now := time.Now()
	id := randomID(t)
	longKey := func(last byte) string {
		return id + strings.Repeat("k", idem.DefaultMaxKeyLength-len(id)-1) + string(last)
	}
	longScope := func(last byte) string {
		return id + strings.Repeat("s", idem.MaxStoredScopeLength-len(id)-1) + string(last)
	}
	pairs := [][2]fixture{
		{{scope: id, key: longKey('a')}, {scope: id, key: longKey('b')}},
		{{scope: longScope('a'), key: "k"}, {scope: longScope('b'), key: "k"}},
		{{scope: longScope('a'), key: longKey('a')}, {scope: longScope('b'), key: longKey('b')}},
	}
	for _, p := range pairs {
		a, b := p[0], p[1]
		ra := a.claim("v1:a", now, time.Minute, longTTL)
		rb := b.claim("v1:b", now, time.Minute, longTTL)
		checkInFlight(t, mustClaim(t, s, ra), ra)
		checkInFlight(t, mustClaim(t, s, rb), rb)
		if err := s.Complete(ctxFor(t), a.scope, a.key, ra.Token, &idem.Response{Status: 201, Body: []byte("a")}, now, now.Add(longTTL)); err != nil {
			t.Fatalf("Complete of a %d-byte key in a %d-byte scope: %v", len(a.key), len(a.scope), err)
		}
		checkInFlight(t, mustGet(t, s, b, now), rb)
		got := mustGet(t, s, a, now)
		if got.Scope != a.scope || got.Key != a.key || got.State != idem.StateComplete || got.Response == nil || string(got.Response.Body) != "a" {
			t.Errorf("record (%d-byte scope, %d-byte key) = %+v, want it complete with body a, its scope and key whole", len(a.scope), len(a.key), got)
		}
		if err := s.Release(ctxFor(t), b.scope, b.key, rb.Token); err != nil {
			t.Fatalf("Release of the second long key: %v", err)
		}
		wantNotFound(t, s, b, now)
		mustGet(t, s, a, now)
	}
}

func testJanitor(t *testing.T, s idem.Store) {
	const (
		ttl     = 300 * time.Millisecond
		expired = 25
		live    = 5
		batch   = 10
	)
	ctx := ctxFor(t)
	now := time.Now()
	var gone, kept []fixture
	for i := range expired {
		f := newFixture(t)
		req := f.claim("v1:j", now, ttl, ttl)
		mustClaim(t, s, req)
		if i%2 == 0 { // half complete, half left in flight
			if err := s.Complete(ctx, f.scope, f.key, req.Token, &idem.Response{Status: 200}, now, now.Add(ttl)); err != nil {
				t.Fatalf("Complete: %v", err)
			}
		}
		gone = append(gone, f)
	}
	for i := range live {
		f := newFixture(t)
		// The lease lapses before the janitor runs: a record counts until its
		// expiry, whatever its lease (an in-flight one with a lapsed lease is
		// what LapsedRefuse keeps for an operator).
		req := f.claim("v1:j", now, ttl, longTTL)
		mustClaim(t, s, req)
		if i%2 == 0 {
			if err := s.Complete(ctx, f.scope, f.key, req.Token, &idem.Response{Status: 200}, now, now.Add(longTTL)); err != nil {
				t.Fatalf("Complete: %v", err)
			}
		}
		kept = append(kept, f)
	}
	time.Sleep(ttl + 50*time.Millisecond)
	cutoff := time.Now()
	var counts []int
	total := 0
	for range expired {
		n, err := s.DeleteExpired(ctx, cutoff, batch)
		if err != nil {
			t.Fatalf("DeleteExpired: %v", err)
		}
		if n > batch {
			t.Fatalf("DeleteExpired(limit %d) deleted %d records", batch, n)
		}
		counts = append(counts, n)
		total += n
		if n < batch {
			break
		}
	}
	if se, ok := s.(SelfExpiring); ok && se.ExpiresRecordsItself() {
		if total != 0 {
			t.Errorf("a self-expiring store's DeleteExpired deleted %d records, want 0", total)
		}
	} else if want := []int{10, 10, 5}; fmt.Sprint(counts) != fmt.Sprint(want) {
		t.Errorf("DeleteExpired batches = %v, want %v", counts, want)
	}
	for _, f := range gone {
		wantNotFound(t, s, f, cutoff)
		// Asked with a clock from before the expiry, a deleted record is still absent.
		if _, err := s.Get(ctx, f.scope, f.key, now); !errors.Is(err, idem.ErrNotFound) {
			t.Errorf("record (%q, %q) still stored after the janitor ran (Get: %v)", f.scope, f.key, err)
		}
	}
	for _, f := range kept {
		mustGet(t, s, f, cutoff)
	}
}

// testLiveLeasePastTTL: a handler that runs longer than the TTL keeps its record
// in flight for as long as its lease is renewed. The record is never absent,
// never reclaimed (with the same or another fingerprint), never deleted by the
// janitor or by the store's own expiry, and the handler's completion succeeds.
func testLiveLeasePastTTL(t *testing.T, s idem.Store) {
	const (
		lease = 150 * time.Millisecond
		ttl   = 300 * time.Millisecond
		run   = 900 * time.Millisecond // three TTLs
	)
	ctx := ctxFor(t)
	f := newFixture(t)
	start := time.Now()
	req := f.claim("v1:long", start, lease, ttl)
	mustClaim(t, s, req)
	for time.Since(start) < run {
		time.Sleep(lease / 3)
		now := time.Now()
		if err := s.Extend(ctx, f.scope, f.key, req.Token, now, now.Add(lease)); err != nil {
			t.Fatalf("Extend at %v: %v", now.Sub(start), err)
		}
		if now.Sub(start) < ttl+lease/3 {
			continue // check once the TTL has passed
		}
		if rec := mustGet(t, s, f, now); rec.State != idem.StateInFlight || rec.Token != req.Token {
			t.Fatalf("at %v (past the TTL) the record is %v under %q, want in flight under the renewing token", now.Sub(start), rec.State, rec.Token)
		} else if rec.ExpiresAt.Before(rec.LeaseUntil) {
			t.Errorf("ExpiresAt %v is before LeaseUntil %v: Extend must keep a live lease from expiring", rec.ExpiresAt, rec.LeaseUntil)
		}
		for _, fp := range []string{"v1:long", "v1:another-body"} {
			retry := f.claim(fp, now, lease, ttl)
			if rec := mustNotClaim(t, s, retry); rec.Token != req.Token {
				t.Fatalf("at %v a retry (%s) claimed the live record", now.Sub(start), fp)
			}
		}
		if _, err := s.DeleteExpired(ctx, now, 100); err != nil {
			t.Fatalf("DeleteExpired: %v", err)
		}
		mustGet(t, s, f, now)
	}
	done := time.Now()
	resp := &idem.Response{Status: 201, Body: []byte("once")}
	if err := s.Complete(ctx, f.scope, f.key, req.Token, resp, done, done.Add(ttl)); err != nil {
		t.Fatalf("the long handler's Complete after %v: %v", done.Sub(start), err)
	}
	checkResponse(t, mustGet(t, s, f, done).Response, resp)
}

// testHeaderBytesExact: header values are kept byte for byte, including bytes
// that are not UTF-8 (a Location with a Latin-1 file name), so that a replay is
// exactly what the first answer sent.
func testHeaderBytesExact(t *testing.T, s idem.Store) {
	f := newFixture(t)
	now := time.Now()
	req := f.claim("v1:hdr", now, time.Minute, longTTL)
	mustClaim(t, s, req)
	resp := &idem.Response{Status: 201, Header: http.Header{
		"Location":            {"/files/caf\xe9.pdf"},
		"Content-Disposition": {"attachment; filename=\"\xff\xfe\x80.txt\""},
		"Link":                {"<a>; rel=\"\xc3\x28\"", "\xf0\x28\x8c\x28", "\\u00e9 \"quoted\" \t"},
		"Etag":                {"W/\"\xe2\x82\""},
	}, Body: []byte("{}")}
	if err := s.Complete(ctxFor(t), f.scope, f.key, req.Token, resp, now, now.Add(longTTL)); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	checkResponse(t, mustGet(t, s, f, now).Response, resp)
}

// testResponseCopied: a store that says it copies what it keeps of a response
// (idem.ResponseCopier) does: the middleware reuses the memory for a later
// request once Complete (or, in a transaction, Commit) returned.
func testResponseCopied(t *testing.T, s idem.Store) {
	if c, ok := s.(idem.ResponseCopier); !ok || !c.CopiesResponses() {
		t.Skip("the store does not implement idem.ResponseCopier: the middleware gives it a Response of its own to keep, and there is nothing to check")
	}
	complete := map[string]func(f fixture, token string, resp *idem.Response, now time.Time) error{
		"Complete": func(f fixture, token string, resp *idem.Response, now time.Time) error {
			return s.Complete(ctxFor(t), f.scope, f.key, token, resp, now, now.Add(longTTL))
		},
	}
	if ts, ok := s.(idem.TxStore); ok {
		complete["Tx.Complete"] = func(f fixture, token string, resp *idem.Response, now time.Time) error {
			ctx, tx, err := ts.BeginTx(ctxFor(t))
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctxFor(t)) }()
			if err := tx.Complete(ctx, f.scope, f.key, token, resp, now, now.Add(longTTL)); err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	}
	if ls, ok := s.(idem.SingleTxStore); ok {
		complete["LockedTx.Insert"] = func(f fixture, _ string, resp *idem.Response, now time.Time) error {
			ctx, tx, rec, err := ls.BeginLocked(ctxFor(t), f.scope, f.key, now)
			if err != nil {
				return err
			}
			defer func() { _ = tx.Rollback(ctxFor(t)) }()
			if rec != nil {
				return fmt.Errorf("BeginLocked found a record on a fresh key: %+v", rec)
			}
			err = tx.Insert(ctx, &idem.Record{
				Scope: f.scope, Key: f.key, State: idem.StateComplete, Fingerprint: "v1:copied",
				Token: "tok-" + randToken(), CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(longTTL), Response: resp,
			})
			if err != nil {
				return err
			}
			return tx.Commit(ctx)
		}
	}
	for name, completeWith := range complete {
		t.Run(name, func(t *testing.T) {
			f := newFixture(t)
			now := time.Now()
			var token string
			if name != "LockedTx.Insert" {
				req := f.claim("v1:copied", now, time.Minute, longTTL)
				mustClaim(t, s, req)
				token = req.Token
			}
			vals := []string{"/orders/1", "application/json", "a", "b"}
			body := []byte(`{"id":1}`)
			resp := &idem.Response{Status: 201, Header: http.Header{
				"Location": vals[0:1:1], "Content-Type": vals[1:2:2], "Link": vals[2:4:4],
			}, Body: body, Ref: "ref-1"}
			want := &idem.Response{Status: 201, Header: http.Header{
				"Location": {"/orders/1"}, "Content-Type": {"application/json"}, "Link": {"a", "b"},
			}, Body: []byte(`{"id":1}`), Ref: "ref-1"}
			if err := completeWith(f, token, resp, now); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			// What the middleware's next request does to the same memory.
			for i := range vals {
				vals[i] = "reused"
			}
			copy(body, "XXXXXXXX")
			clear(resp.Header)
			resp.Header["Location"] = []string{"/orders/2"}
			*resp = idem.Response{Status: 500, Header: resp.Header, Body: body}
			checkResponse(t, mustGet(t, s, f, now).Response, want)
		})
	}
}

// testClockSkew: a store compares only the times it is given and never reads a
// clock of its own. With the middleware's clock skew away from the store's
// (a test clock, or an application host whose clock is off), claims, leases and
// expiry follow the middleware's clock: a live claim is not lost, a lapsed one is
// taken over, and an expired record is absent.
func testClockSkew(t *testing.T, s idem.Store, skew time.Duration) {
	const (
		lease = 30 * time.Second
		ttl   = time.Minute
	)
	ctx := ctxFor(t)
	f := newFixture(t)
	now := time.Now().Add(skew)
	req := f.claim("v1:skew", now, lease, ttl)
	mustClaim(t, s, req)
	time.Sleep(50 * time.Millisecond) // a store with its own expiry gets time to act on it
	soon := now.Add(time.Second)
	checkInFlight(t, mustGet(t, s, f, soon), req)
	if rec := mustNotClaim(t, s, f.claim("v1:skew", soon, lease, ttl)); rec.Token != req.Token {
		t.Fatalf("a second claim took the live record over")
	}
	if err := s.Extend(ctx, f.scope, f.key, req.Token, soon, soon.Add(lease)); err != nil {
		t.Fatalf("Extend: %v", err)
	}
	// Past the lease by the middleware's clock: taken over.
	lapsed := soon.Add(lease + time.Second)
	taker := f.claim("v1:skew", lapsed, lease, ttl)
	mustClaim(t, s, taker)
	time.Sleep(50 * time.Millisecond)
	doneAt := lapsed.Add(time.Second)
	resp := &idem.Response{Status: 200, Body: []byte("skewed")}
	if err := s.Complete(ctx, f.scope, f.key, taker.Token, resp, doneAt, doneAt.Add(ttl)); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	time.Sleep(50 * time.Millisecond)
	rec := mustGet(t, s, f, doneAt.Add(ttl-time.Second))
	checkResponse(t, rec.Response, resp)
	// Past the expiry by the middleware's clock: absent, and claimed afresh.
	gone := doneAt.Add(ttl + time.Second)
	wantNotFound(t, s, f, gone)
	mustClaim(t, s, f.claim("v1:new", gone, lease, ttl))
}

// testLongestTTL: the longest TTL a time.Duration can say (292 years; idem.New
// and idem resolve accept it) puts ExpiresAt past 2262, where a time no longer
// fits in int64 nanoseconds. The record must still count, in flight and
// complete, and the janitor must leave it: wrapped around into the past it
// would expire at once and the next request would run again.
func testLongestTTL(t *testing.T, s idem.Store) {
	ctx := ctxFor(t)
	f := newFixture(t)
	const forever = time.Duration(math.MaxInt64)
	now := time.Now()
	first := mustClaim(t, s, f.claim("v1:long", now, time.Minute, forever))
	if rec, claimed, err := s.Claim(ctx, f.claim("v1:long", now, time.Minute, forever)); err != nil || claimed || rec.Token != first.Token {
		t.Fatalf("second Claim with the longest TTL = %+v, %v, %v; want the first claim's live record", rec, claimed, err)
	}
	if rec, err := s.Get(ctx, f.scope, f.key, now); err != nil || rec.State != idem.StateInFlight {
		t.Fatalf("Get after a Claim with the longest TTL = %+v, %v; want it in flight", rec, err)
	}
	now = time.Now()
	if err := s.Complete(ctx, f.scope, f.key, first.Token, &idem.Response{Status: 201, Body: []byte("kept")}, now, now.Add(forever)); err != nil {
		t.Fatalf("Complete with the longest TTL: %v", err)
	}
	if _, err := s.DeleteExpired(ctx, time.Now().Add(24*time.Hour), 100); err != nil {
		t.Fatalf("DeleteExpired: %v", err)
	}
	rec, err := s.Get(ctx, f.scope, f.key, time.Now().Add(24*time.Hour))
	if err != nil || rec.State != idem.StateComplete || rec.Response == nil || rec.Response.Status != 201 || string(rec.Response.Body) != "kept" {
		t.Fatalf("Get a day after Complete with the longest TTL = %+v, %v; want the complete record", rec, err)
	}
	if rec, claimed, err := s.Claim(ctx, f.claim("v1:long", time.Now(), time.Minute, forever)); err != nil || claimed || rec.State != idem.StateComplete {
		t.Fatalf("Claim after Complete with the longest TTL = %+v, %v, %v; want the complete record replayed", rec, claimed, err)
	}
}
