package idem_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// The default fingerprint covers the query string: /pay?amount=1 and
// /pay?amount=1000 with one key and one body are two requests (422), not a
// replay of each other.
func TestQueryStringIsFingerprinted(t *testing.T) {
	t.Parallel()
	o := &orders{}
	b := setup(t, nil, o)
	first := b.do(t, http.MethodPost, "/pay?amount=1", "{}", "Idempotency-Key", "q1")
	if first.status != http.StatusCreated {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/pay?amount=1000", "{}", "Idempotency-Key", "q1"), http.StatusUnprocessableEntity, idem.CodeKeyReused)
	wantProblem(t, b.do(t, http.MethodPost, "/pay", "{}", "Idempotency-Key", "q1"), http.StatusUnprocessableEntity, idem.CodeKeyReused)
	again := b.do(t, http.MethodPost, "/pay?amount=1", "{}", "Idempotency-Key", "q1")
	if again.status != http.StatusCreated || again.header.Get(idem.ReplayedHeader) != "true" || string(again.body) != string(first.body) {
		t.Fatalf("retry with the same query: %d %q, replayed %q; want the first answer replayed", again.status, again.body, again.header.Get(idem.ReplayedHeader))
	}
	if n := o.runs.Load(); n != 1 {
		t.Fatalf("the handler ran %d times, want 1", n)
	}
}

func TestFingerprintV3(t *testing.T) {
	t.Parallel()
	fp := func(f idem.FingerprintFunc, method, target, body string) string {
		return f(httptest.NewRequest(method, target, nil), []byte(body))
	}
	base := fp(idem.FingerprintV3, "POST", "/pay?amount=1", "{}")
	if !strings.HasPrefix(base, "v3:") || len(base) != 3+64 {
		t.Fatalf("fingerprint %q: want v3: and 64 hex digits", base)
	}
	// Pinned: method, escaped path, raw query and body, each after its length
	// as 8 big-endian bytes.
	var in []byte
	for _, part := range []string{"POST", "/pay", "amount=1", "{}"} {
		in = append(in, 0, 0, 0, 0, 0, 0, 0, byte(len(part)))
		in = append(in, part...)
	}
	sum := sha256.Sum256(in)
	if want := "v3:" + hex.EncodeToString(sum[:]); base != want {
		t.Errorf("FingerprintV3 = %s, want %s", base, want)
	}
	differ := map[string]string{
		"query":        fp(idem.FingerprintV3, "POST", "/pay?amount=1000", "{}"),
		"no query":     fp(idem.FingerprintV3, "POST", "/pay", "{}"),
		"query order":  fp(idem.FingerprintV3, "POST", "/pay?amount=1&x=2", "{}"),
		"shifted":      fp(idem.FingerprintV3, "POST", "/pay?amount=1{", "}"),
		"path":         fp(idem.FingerprintV3, "POST", "/pay/?amount=1", "{}"),
		"escaped path": fp(idem.FingerprintV3, "POST", "/p%61y?amount=1", "{}"),
		"method":       fp(idem.FingerprintV3, "PUT", "/pay?amount=1", "{}"),
	}
	for what, other := range differ {
		if other == base {
			t.Errorf("changing the %s kept the fingerprint", what)
		}
	}
	if a, b := fp(idem.FingerprintV3, "POST", "/pay?x=2&y=3", "{}"), fp(idem.FingerprintV3, "POST", "/pay?y=3&x=2", "{}"); a == b {
		t.Error("?x=2&y=3 and ?y=3&x=2 share a fingerprint; the query is compared as sent")
	}
	long := "/pay?" + strings.Repeat("q", 4000)
	if a, b := fp(idem.FingerprintV3, "POST", long, "{}"), fp(idem.FingerprintV3, "POST", long+"q", "{}"); a == b || a != fp(idem.FingerprintV3, "POST", long, "{}") {
		t.Error("a long query is not fingerprinted deterministically and in full")
	}
	// v2 is unchanged: it ignores the query.
	if fp(idem.FingerprintV2, "POST", "/pay?amount=1", "{}") != fp(idem.FingerprintV2, "POST", "/pay?amount=1000", "{}") {
		t.Error("v2 changed: it does not cover the query")
	}
}

// A record stored under v2 (before v3 was the default) is compared with v2,
// which ignores the query: its retries still replay after an upgrade.
func TestV2RecordsAreComparedWithV2(t *testing.T) {
	t.Parallel()
	o := &orders{}
	b := setup(t, nil, o)
	req := httptest.NewRequest(http.MethodPost, "/pay?amount=1", strings.NewReader("{}"))
	now := time.Now()
	claim := idem.ClaimRequest{Key: "old", Fingerprint: idem.FingerprintV2(req, []byte("{}")), Token: "old-token",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}
	ctx := context.Background()
	if _, ok, err := b.store.Claim(ctx, claim); err != nil || !ok {
		t.Fatalf("claim: %v %v", ok, err)
	}
	if err := b.store.Complete(ctx, "", "old", "old-token", &idem.Response{Status: 201, Body: []byte("stored under v2")}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	for _, target := range []string{"/pay?amount=1", "/pay?amount=2"} {
		a := b.do(t, http.MethodPost, target, "{}", "Idempotency-Key", "old")
		if a.status != 201 || string(a.body) != "stored under v2" {
			t.Errorf("%s: %d %q, want the v2 record replayed", target, a.status, a.body)
		}
	}
	wantProblem(t, b.do(t, http.MethodPost, "/pay?amount=1", "{\"other\":1}", "Idempotency-Key", "old"), http.StatusUnprocessableEntity, idem.CodeKeyReused)
	if n := o.runs.Load(); n != 0 {
		t.Fatalf("the handler ran %d times, want 0", n)
	}
}

// Two routes share a store, one with a custom fingerprint of its own version
// ("acme1:", as FingerprintFunc documents), one with the default. A key sent
// to one after the other is a 422 in both orders: a fingerprint version idem
// has no algorithm for is never a match.
// (The single-transaction flow is checked on SQLite, in sqlitestore.)
func TestUnknownFingerprintVersionIsAMismatch(t *testing.T) {
	t.Parallel()
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	var charges, refunds atomic.Int64
	custom := func(r *http.Request, body []byte) string {
		sum := sha256.Sum256(body)
		return "acme1:" + hex.EncodeToString(sum[:])
	}
	charge, err := idem.New(store, &idem.Config{FingerprintFunc: custom})
	if err != nil {
		t.Fatal(err)
	}
	refund, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /charge", charge(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "charge %d", charges.Add(1))
	})))
	mux.Handle("POST /refund", refund(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "refund %d", refunds.Add(1))
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	b := &bundle{server: srv, client: &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 30 * time.Second}}

	if a := b.do(t, http.MethodPost, "/charge", `{"amount":5}`, "Idempotency-Key", "k1"); a.status != 201 {
		t.Fatalf("charge: %d %s", a.status, a.body)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/refund", `{"amount":5}`, "Idempotency-Key", "k1"), http.StatusUnprocessableEntity, idem.CodeKeyReused)
	if a := b.do(t, http.MethodPost, "/refund", `{"amount":5}`, "Idempotency-Key", "k2"); a.status != 201 {
		t.Fatalf("refund: %d %s", a.status, a.body)
	}
	wantProblem(t, b.do(t, http.MethodPost, "/charge", `{"amount":5}`, "Idempotency-Key", "k2"), http.StatusUnprocessableEntity, idem.CodeKeyReused)
	if c, r := charges.Load(), refunds.Load(); c != 1 || r != 1 {
		t.Fatalf("charges ran %d times and refunds %d, want 1 each", c, r)
	}
}
