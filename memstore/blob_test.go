package memstore

import (
	"context"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// Two records whose hashes collide live side by side: one in the map, one in
// overflow, each found, replaced and removed as itself.
func TestHashCollision(t *testing.T) {
	sh := &shard{records: make(map[uint64][]byte)}
	now := time.Now()
	blob := func(key, tok string) []byte {
		return encode(idem.StateInFlight, "s", key, []byte("v2:x"), tok, now, now, now.Add(time.Hour), nil)
	}
	put := func(key string, b []byte) { // as Claim and Complete store a record
		_, p := sh.find(7, "s", key)
		sh.set(7, "s", key, b, p)
	}
	put("a", blob("a", "ta"))
	put("b", blob("b", "tb"))
	if got := tokenOf(sh.get(7, "s", "a")); got != "ta" {
		t.Fatalf("a: token %q", got)
	}
	if got := tokenOf(sh.get(7, "s", "b")); got != "tb" {
		t.Fatalf("b: token %q", got)
	}
	put("b", blob("b", "tb2"))
	if got := tokenOf(sh.get(7, "s", "b")); got != "tb2" || len(sh.overflow) != 1 {
		t.Fatalf("b replaced: token %q, %d in overflow", got, len(sh.overflow))
	}
	sh.remove(7, "s", "a")
	if sh.get(7, "s", "a") != nil || tokenOf(sh.get(7, "s", "b")) != "tb2" {
		t.Fatal("removing a disturbed b")
	}
	put("b", blob("b", "tb3")) // replaced in overflow while the map slot is free
	if tokenOf(sh.get(7, "s", "b")) != "tb3" || len(sh.overflow) != 1 || sh.records[7] != nil {
		t.Fatalf("b replaced after a's removal: token %q, %d in overflow", tokenOf(sh.get(7, "s", "b")), len(sh.overflow))
	}
	put("a", blob("a", "ta2")) // the map slot is free again
	if tokenOf(sh.get(7, "s", "a")) != "ta2" || tokenOf(sh.get(7, "s", "b")) != "tb3" || sh.records[7] == nil {
		t.Fatal("a and b after a re-put")
	}
	sh.remove(7, "s", "b")
	if sh.get(7, "s", "b") != nil || len(sh.overflow) != 0 {
		t.Fatal("b not removed from overflow")
	}
}

// A blob round-trips every field of a complete record.
func TestBlobRoundTrip(t *testing.T) {
	now := time.Unix(1700000000, 123456789)
	resp := &idem.Response{Status: 201, Header: http.Header{"Location": {"/o/1"}, "Link": {"a", "b\xff"}},
		Body: []byte("body\x00"), Ref: "ref"}
	rec := decode(encode(idem.StateComplete, "scope", "key", []byte("v2:fp"), "tok", now, now.Add(time.Second), now.Add(time.Hour), resp), "")
	if rec.Scope != "scope" || rec.Key != "key" || rec.Fingerprint != "v2:fp" || rec.Token != "tok" || rec.State != idem.StateComplete ||
		!rec.CreatedAt.Equal(now) || !rec.LeaseUntil.Equal(now.Add(time.Second)) || !rec.ExpiresAt.Equal(now.Add(time.Hour)) {
		t.Fatalf("record = %+v", rec)
	}
	r := rec.Response
	if r.Status != 201 || string(r.Body) != "body\x00" || r.Ref != "ref" || r.BodyOmitted ||
		r.Header.Get("Location") != "/o/1" || len(r.Header["Link"]) != 2 || r.Header["Link"][1] != "b\xff" {
		t.Fatalf("response = %+v", r)
	}
}

// Headers beyond what decode and encode keep in their own memory (more than
// four values, more than 256 bytes encoded) round-trip too, each value slice
// capped so that an append to one never overwrites the next.
func TestBlobRoundTripLargeHeader(t *testing.T) {
	now := time.Unix(1700000000, 0)
	long := strings.Repeat("x", 300)
	hdr := http.Header{"Link": {"a", "b", "c"}, "X-Long": {long}, "Location": {"/o/1"}, "Vary": {"A", "B"}}
	rec := decode(encode(idem.StateComplete, "s", "k", []byte("v2:fp"), "", now, now, now, &idem.Response{Status: 200, Header: hdr, Body: []byte("b")}), "")
	got := rec.Response.Header
	if len(got) != len(hdr) {
		t.Fatalf("header = %q, want %q", got, hdr)
	}
	for name, vals := range hdr {
		if strings.Join(got[name], "|") != strings.Join(vals, "|") || cap(got[name]) != len(vals) {
			t.Errorf("%s = %q (capacity %d), want %q", name, got[name], cap(got[name]), vals)
		}
	}
	if string(rec.Response.Body) != "b" {
		t.Errorf("body = %q", rec.Response.Body)
	}
}

// Fingerprints round-trip through their stored form, packed or not, and match
// exactly themselves.
func TestFingerprintStoredForm(t *testing.T) {
	hex64 := "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	for _, fp := range []string{
		"v2:" + hex64, "v1:" + hex64, "v10:" + hex64, // packed
		"v2:" + strings.ToUpper(hex64), "v2:" + hex64[:63], "v2:" + hex64 + "0", ":" + hex64, "v2:" + hex64[:62] + "g0",
		"", "v2:x", "\x00" + hex64, "\x00\x01", "\x01", "\x00v2:" + hex64, "v2:" + hex64[:31] + ":" + hex64[32:],
		string(make([]byte, 32)), // a custom FingerprintFunc's raw digest
	} {
		stored := packFP(nil, fp)
		if got := unpackFP(stored); got != fp {
			t.Errorf("%q: unpacked %q", fp, got)
		}
		if !fpMatches(stored, fp) {
			t.Errorf("%q does not match its stored form", fp)
		}
		for _, other := range []string{"", "v2:" + hex64, "v2:" + hex64[:63] + "9", "v3:" + hex64, "v2:" + strings.ToUpper(hex64), "x" + fp, fp + "x"} {
			if other != fp && fpMatches(stored, other) {
				t.Errorf("%q matches the stored form of %q", other, fp)
			}
		}
	}
	if n := len(packFP(nil, "v2:"+hex64)); n != 35 {
		t.Errorf("packed v2 fingerprint is %d bytes, want 35", n)
	}
}

// BenchmarkMemoryPerRecord reports the live heap per complete record of the
// orders answer (a 120-byte JSON body, Content-Type and Location), as
// B/record, after 150,000 records.
func BenchmarkMemoryPerRecord(b *testing.B) {
	const records = 150_000
	body := []byte(`{"id":"ord_1d4f14a87fc449d47bb41c7c","cart_id":"c_42","total_cents":1900,"created_at":"2026-11-30T17:14:26.07043Z"}`)
	for b.Loop() {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		s := New(&Config{JanitorInterval: -1})
		now := time.Now()
		for i := range records {
			key := "8e03978e-40d5-43e8-bc93-" + strconv.Itoa(100000000000+i)
			req := idem.ClaimRequest{Scope: "tenant-1", Key: key, Fingerprint: "v2:9157" + strings.Repeat("a", 60), Token: "AAAAAAAAAAAAAAAAAAAAAA",
				Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
			_, _, _ = s.Claim(context.Background(), req)
			_ = s.Complete(context.Background(), "tenant-1", key, req.Token, &idem.Response{Status: 201,
				Header: http.Header{"Content-Type": {"application/json"}, "Location": {"/orders/ord_1d4f14a87fc449d47bb41c7c"}},
				Body:   body}, now, now.Add(time.Hour))
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/records, "B/record")
		runtime.KeepAlive(s)
	}
}
