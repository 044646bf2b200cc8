package idem_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// TestConfigRefusesWhatCannotWork: a setting that would make the middleware
// do something other than the user wrote is an error from New that names the
// field and says what to change, never a panic and never a silent fix.
func TestConfigRefusesWhatCannotWork(t *testing.T) {
	t.Parallel()
	store := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = store.Close() })
	bad := []struct {
		name string
		cfg  idem.Config
		want string // in the error
	}{
		// A header name no request can carry: every keyed request would be 400
		// idempotency_key_missing (or, with KeyOptional, unprotected).
		{"HeaderName with a space", idem.Config{HeaderName: "Idempotency Key"}, "HeaderName"},
		{"HeaderName with CR LF", idem.Config{HeaderName: "Idempotency-Key\r\nX-Evil: 1"}, "HeaderName"},
		{"HeaderName with a colon", idem.Config{HeaderName: "Idempotency-Key:"}, "HeaderName"},
		{"HeaderName non-ASCII", idem.Config{HeaderName: "Idempotenz-Schlüssel"}, "HeaderName"},
		{"HeaderName Host", idem.Config{HeaderName: "host"}, "HeaderName"},
		{"HeaderName hop-by-hop", idem.Config{HeaderName: "Connection"}, "HeaderName"},
		// Methods that match nothing: the routes would run unprotected.
		{"Methods empty", idem.Config{Methods: []string{}}, "Methods"},
		{"Methods with an empty name", idem.Config{Methods: []string{"POST", ""}}, "Methods"},
		{"Methods with a space", idem.Config{Methods: []string{"POST PATCH"}}, "Methods"},
		{"Methods with a path", idem.Config{Methods: []string{"POST /orders"}}, "Methods"},
		// Stored headers that match nothing, or must never be replayed.
		{"StoredHeaders Set-Cookie", idem.Config{StoredHeaders: []string{"set-cookie"}}, "Set-Cookie"},
		{"StoredHeaders empty name", idem.Config{StoredHeaders: []string{""}}, "StoredHeaders"},
		{"StoredHeaders invalid name", idem.Config{StoredHeaders: []string{"Content Type"}}, "StoredHeaders"},
		{"StoredHeaders Connection", idem.Config{StoredHeaders: []string{"Location", "connection"}}, "hop-by-hop"},
		{"StoredHeaders Transfer-Encoding", idem.Config{StoredHeaders: []string{"Transfer-Encoding"}}, "hop-by-hop"},
		{"StoredHeaders Keep-Alive", idem.Config{StoredHeaders: []string{"Keep-Alive"}}, "hop-by-hop"},
		{"StoredHeaders Upgrade", idem.Config{StoredHeaders: []string{"Upgrade"}}, "hop-by-hop"},
		// Sizes and durations.
		{"MaxKeyLength over 255", idem.Config{MaxKeyLength: 256}, "MaxKeyLength"},
		{"MaxKeyLength negative", idem.Config{MaxKeyLength: -1}, "MaxKeyLength"},
		{"MaxRequestBody negative", idem.Config{MaxRequestBody: -1}, "MaxRequestBody"},
		{"MaxStoredBody negative", idem.Config{MaxStoredBody: math.MinInt}, "MaxStoredBody"},
		{"Lease negative", idem.Config{Lease: -time.Second}, "Lease"},
		{"Lease tiny", idem.Config{Lease: time.Nanosecond}, "Lease"},
		{"TTL negative", idem.Config{TTL: -time.Hour}, "TTL"},
		{"Lease longer than the default TTL", idem.Config{Lease: 48 * time.Hour}, "TTL"},
		{"CleanupTimeout negative", idem.Config{CleanupTimeout: -1}, "CleanupTimeout"},
		{"LapsedLease unknown", idem.Config{LapsedLease: 2}, "LapsedLease"},
		{"Flow unknown", idem.Config{Flow: 3}, "Flow"},
		{"FlowSingleTx on memstore", idem.Config{Flow: idem.FlowSingleTx}, "SingleTxStore"},
	}
	for _, tc := range bad {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.cfg
			_, err := idem.New(store, &cfg)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New = %v, want an error naming %s", err, tc.want)
			}
			if verr := (&cfg).Validate(); tc.want != "SingleTxStore" && (verr == nil || verr.Error() != err.Error()) {
				t.Errorf("Validate = %v, want New's error %v", verr, err)
			}
			if strings.ContainsAny(err.Error(), "\r\n") && !strings.Contains(err.Error(), `\r\n`) {
				t.Errorf("the error carries a raw line break: %q", err)
			}
		})
	}
	// Errors are joined: every problem is named at once.
	_, err := idem.New(store, &idem.Config{HeaderName: "a b", Methods: []string{""}, MaxRequestBody: -1})
	for _, field := range []string{"HeaderName", "Methods", "MaxRequestBody"} {
		if err == nil || !strings.Contains(err.Error(), field) {
			t.Errorf("New with three bad fields = %v, want %s named", err, field)
		}
	}
	// And a nil store.
	if _, err := idem.New(nil, nil); err == nil || !strings.Contains(err.Error(), "store is nil") {
		t.Errorf("New(nil, nil) = %v, want an error that says the store is nil", err)
	}
}

// TestConfigExtremesWork: the largest values a field can hold, and lists with
// repeats, are accepted and mean what they say.
func TestConfigExtremesWork(t *testing.T) {
	t.Parallel()
	store := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = store.Close() })
	good := map[string]idem.Config{
		"longest durations": {Lease: math.MaxInt64, TTL: math.MaxInt64, CleanupTimeout: math.MaxInt64, HandlerTimeout: math.MaxInt64},
		"largest sizes":     {MaxRequestBody: math.MaxInt64, MaxStoredBody: math.MaxInt, MaxKeyLength: 255},
		"repeated methods":  {Methods: []string{"POST", "post", "POST", "Patch"}},
		"repeated headers":  {StoredHeaders: []string{"Location", "location", "LOCATION"}},
		"no stored headers": {StoredHeaders: []string{}},
		"custom header":     {HeaderName: "x-request-key"},
	}
	for name, cfg := range good {
		if _, err := idem.New(store, &cfg); err != nil {
			t.Errorf("%s: New = %v, want it accepted", name, err)
		}
	}
	mw, err := idem.New(store, &idem.Config{HeaderName: "x-request-key", StoredHeaders: []string{"Location", "location"}})
	if err != nil {
		t.Fatal(err)
	}
	runs := 0
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs++
		w.Header().Set("Location", "/orders/1")
		w.WriteHeader(201)
	})))
	t.Cleanup(srv.Close)
	for i := range 2 {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("{}"))
		req.Header.Set("X-Request-Key", "k")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 201 || len(resp.Header.Values("Location")) != 1 {
			t.Errorf("answer %d: %d, Location %q; want 201 and one Location", i+1, resp.StatusCode, resp.Header.Values("Location"))
		}
	}
	if runs != 1 {
		t.Errorf("the handler ran %d times for one key under a custom HeaderName, want 1", runs)
	}
}

// TestLargestMaxRequestBody: MaxRequestBody at its largest value is "no
// limit", not an overflow. Before, a chunked body was read through
// io.LimitReader(body, MaxRequestBody+1), which wrapped round to a negative
// limit: the body was fingerprinted as empty and the handler got none of it.
// And a Content-Length within the limit is only a claim: memory is not taken
// for a terabyte before the bytes arrive (it was, in one make: the process
// died of it).
func TestLargestMaxRequestBody(t *testing.T) {
	t.Parallel()
	store := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, &idem.Config{MaxRequestBody: math.MaxInt64})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(201)
		fmt.Fprintf(w, "got %q", b)
	})))
	t.Cleanup(srv.Close)

	// Chunked (no Content-Length): io.Reader that is not a known type.
	req, _ := http.NewRequest("POST", srv.URL, io.MultiReader(strings.NewReader(`{"cart_id":`), strings.NewReader(`"c_42"}`)))
	req.Header.Set("Idempotency-Key", "chunked")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 201 || string(body) != `got "{\"cart_id\":\"c_42\"}"` {
		t.Errorf("chunked body under the largest MaxRequestBody: %d %s, want 201 with the body the client sent", resp.StatusCode, body)
	}

	// A Content-Length of 1 TiB, 10 bytes sent, then the client stops sending.
	conn, err := net.Dial("tcp", srv.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST / HTTP/1.1\r\nHost: x\r\nIdempotency-Key: huge\r\nContent-Length: %d\r\n\r\n0123456789", int64(1)<<40)
	_ = conn.(*net.TCPConn).CloseWrite()
	_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
	resp, err = http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatalf("no answer to a body shorter than its Content-Length: %v", err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 400 || !strings.Contains(string(body), idem.CodeBodyUnreadable) {
		t.Errorf("a body cut short of its 1 TiB Content-Length: %d %s, want 400 %s", resp.StatusCode, body, idem.CodeBodyUnreadable)
	}
}

// TestErrorCodeTableIsTheCode: the error-code table of docs/errors.md and the problems
// idem writes agree: every code idem has is in the table, under its anchor, with
// the status NewProblem gives it, and the table names no code idem lacks.
func TestErrorCodeTableIsTheCode(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("docs/errors.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| (\\d{3}) \\| <a id=\"([a-z_]+)\"></a>`([a-z_]+)` \\|")
	table := map[string]int{}
	for _, m := range row.FindAllStringSubmatch(string(readme), -1) {
		status, _ := strconv.Atoi(m[1])
		if m[2] != m[3] {
			t.Errorf("docs/errors.md row for %s has the anchor %s", m[3], m[2])
		}
		table[m[3]] = status
	}
	codes := []string{
		idem.CodeKeyMissing, idem.CodeKeyInvalid, idem.CodeKeyInUse, idem.CodeKeyReused,
		idem.CodeBodyTooLarge, idem.CodeBodyUnreadable, idem.CodeStoreUnavailable, idem.CodeLeaseLost,
		idem.CodeCommitFailed, idem.CodeResponseTooLarge, idem.CodeReplayFailed, idem.CodeTxAborted,
		idem.CodeOutcomeUnknown, idem.CodeTxConflict,
	}
	if len(table) != len(codes) {
		t.Errorf("docs/errors.md's error table has %d codes, idem has %d: %v", len(table), len(codes), table)
	}
	for _, code := range codes {
		p := idem.NewProblem(code, "d")
		if p.Type != idem.ProblemTypeBase+code || p.Title == "" || p.Code != code || p.Detail != "d" {
			t.Errorf("NewProblem(%s) = %+v", code, p)
		}
		if st, ok := table[code]; !ok || st != p.Status {
			t.Errorf("%s: docs/errors.md says %d (listed: %v), idem answers %d", code, st, ok, p.Status)
		}
	}
}

// TestProblemsEchoNothingRaw: keys a client can send that are refused — quotes,
// backslashes, markup, bytes past ASCII, a megabyte of them — come back in a
// problem that is valid JSON with every member, whose detail and headers carry
// none of the key: a client's bytes are never reflected into the answer.
func TestProblemsEchoNothingRaw(t *testing.T) {
	t.Parallel()
	store := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })))
	t.Cleanup(srv.Close)
	keys := []string{
		`<script>alert(1)</script>`, `"a\u0000b"`, `"unterminated`, `"a" , "b"`, `a;b=<x>`,
		"caf\xc3\xa9-\xff\xfe", `"\x"`, strings.Repeat("<k>", 300), `"` + strings.Repeat(`\"`, 300) + `"`,
		"x-evil\x1b[31m", `}{"code":"ok"`,
	}
	for _, key := range keys {
		conn, err := net.Dial("tcp", srv.Listener.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(conn, "POST / HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}", key)
		_ = conn.SetReadDeadline(time.Now().Add(30 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			conn.Close()
			t.Fatalf("key %q: %v", key, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		conn.Close()
		if resp.StatusCode == 201 {
			t.Errorf("key %q was accepted", key)
			continue
		}
		if resp.StatusCode != 400 { // net/http's own 400 for a header it cannot parse is not idem's
			t.Errorf("key %q: %d %s, want 400", key, resp.StatusCode, body)
			continue
		}
		if resp.Header.Get("Content-Type") != "application/problem+json" {
			if !strings.Contains(string(body), "400 Bad Request") {
				t.Errorf("key %q: %s %q", key, resp.Header.Get("Content-Type"), body)
			}
			continue // refused by net/http before idem saw it
		}
		var p map[string]any
		if err := json.Unmarshal(body, &p); err != nil {
			t.Errorf("key %q: the problem is not JSON: %v: %q", key, err, body)
			continue
		}
		for _, m := range []string{"type", "title", "status", "detail", "code"} {
			if _, ok := p[m]; !ok {
				t.Errorf("key %q: problem without %q: %s", key, m, body)
			}
		}
		if p["code"] != idem.CodeKeyInvalid {
			t.Errorf("key %q: code %v, want %s", key, p["code"], idem.CodeKeyInvalid)
		}
		detail, _ := p["detail"].(string)
		if !utf8.ValidString(detail) || strings.ContainsFunc(detail, unicode.IsControl) {
			t.Errorf("key %q: the detail carries bytes that are not printable UTF-8: %q", key, detail)
		}
		for _, part := range []string{"<script>", "<k><k>", `\"\"\"`, `{"code":"ok"`, "\x1b"} {
			if strings.Contains(key, part) && strings.Contains(detail, part) {
				t.Errorf("key %q: the detail echoes %q: %q", key, part, detail)
			}
		}
		for name, vals := range resp.Header {
			for _, v := range vals {
				if len(key) > 4 && strings.Contains(v, key) {
					t.Errorf("key %q echoed in the %s header", key, name)
				}
			}
		}
	}
}

// TestNilStoreInAnInterface: the store a constructor returns beside its error
// is a nil pointer; passed on unchecked it was accepted, and every request
// then panicked in the store. New refuses it as it refuses a nil interface.
func TestNilStoreInAnInterface(t *testing.T) {
	t.Parallel()
	var store *memstore.Store
	for _, cfg := range []*idem.Config{nil, {Flow: idem.FlowClaimComplete}, {Flow: idem.FlowSingleTx}} {
		if _, err := idem.New(store, cfg); err == nil || !strings.Contains(err.Error(), "store is nil (*memstore.Store)") {
			t.Errorf("New(nil *memstore.Store, %+v) = %v, want an error that says the store is nil", cfg, err)
		}
	}
}

// TestDefaultsAreTheDocumentedOnes: a nil Config behaves as the README's
// configuration table says, field by field, at each limit and one past it.
func TestDefaultsAreTheDocumentedOnes(t *testing.T) {
	t.Parallel()
	store := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	type seen struct {
		deadline time.Time
		rec      *idem.Record
	}
	seenc := make(chan seen, 1)
	gate, entered := make(chan struct{}), make(chan struct{}, 1)
	const mib = 1 << 20
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/held": // tells what it sees, then waits
			dl, _ := r.Context().Deadline()
			scope, key, _ := idem.KeyFrom(r.Context())
			rec, _ := store.Get(r.Context(), scope, key, time.Now())
			seenc <- seen{dl, rec}
			entered <- struct{}{}
			<-gate
		case "/headers":
			for _, h := range idem.DefaultStoredHeaders {
				w.Header().Set(h, "v-"+h)
			}
			w.Header().Set("X-Not-Kept", "x")
		case "/size":
			n, _ := strconv.Atoi(r.URL.Query().Get("n"))
			_, _ = w.Write([]byte(strings.Repeat("r", n)))
			return
		}
		w.WriteHeader(201)
	})))
	t.Cleanup(srv.Close)
	// Bodies wait for 100 Continue: a body refused (413) before it is read is
	// then not sent, rather than cut off mid-write by the server's close.
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: true, ExpectContinueTimeout: time.Minute}, Timeout: 2 * time.Minute}
	do := func(method, path, key, body string) (int, http.Header, string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		if body != "" {
			req.Header.Set("Expect", "100-continue")
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(b)
	}
	// Methods: POST and PATCH keyed (key required), others pass through.
	for _, m := range []string{"POST", "PATCH"} {
		if st, _, body := do(m, "/", "", ""); st != 400 || !strings.Contains(body, idem.CodeKeyMissing) {
			t.Errorf("%s without a key: %d %s, want 400 %s", m, st, body, idem.CodeKeyMissing)
		}
	}
	for _, m := range []string{"PUT", "DELETE", "GET"} {
		if st, _, _ := do(m, "/", "", ""); st != 201 {
			t.Errorf("%s without a key: %d, want it passed through (201)", m, st)
		}
	}
	// MaxKeyLength 255.
	if st, _, _ := do("POST", "/", strings.Repeat("k", 255), ""); st != 201 {
		t.Errorf("a 255-byte key: %d, want 201", st)
	}
	if st, _, body := do("POST", "/", strings.Repeat("k", 256), ""); st != 400 || !strings.Contains(body, idem.CodeKeyInvalid) {
		t.Errorf("a 256-byte key: %d %s, want 400", st, body)
	}
	// MaxRequestBody 1 MiB.
	if st, _, _ := do("POST", "/", "body-at-limit", strings.Repeat("b", mib)); st != 201 {
		t.Errorf("a 1 MiB body: %d, want 201", st)
	}
	if st, _, body := do("POST", "/", "body-past-limit", strings.Repeat("b", mib+1)); st != 413 || !strings.Contains(body, idem.CodeBodyTooLarge) {
		t.Errorf("a body of 1 MiB + 1: %d %.100s, want 413", st, body)
	}
	// MaxStoredBody 1 MiB: at it, replayed whole; past it, never replayed.
	for _, n := range []int{mib, mib + 1} {
		key := fmt.Sprintf("resp-%d", n)
		path := fmt.Sprintf("/size?n=%d", n)
		if st, _, body := do("POST", path, key, ""); st != 200 || len(body) != n {
			t.Errorf("a %d-byte answer: %d with %d bytes, want it whole", n, st, len(body))
		}
		st, h, body := do("POST", path, key, "")
		if n == mib && (st != 200 || len(body) != n || h.Get(idem.ReplayedHeader) != "true") {
			t.Errorf("retry of a 1 MiB answer: %d, %d bytes, replayed %q; want the replay whole", st, len(body), h.Get(idem.ReplayedHeader))
		}
		if n > mib && (st != 500 || !strings.Contains(body, idem.CodeResponseTooLarge)) {
			t.Errorf("retry of a 1 MiB + 1 answer: %d %.100s, want 500 %s", st, body, idem.CodeResponseTooLarge)
		}
	}
	// StoredHeaders: the eight defaults, and nothing else.
	do("POST", "/headers", "hdr", "")
	_, h, _ := do("POST", "/headers", "hdr", "")
	for _, name := range idem.DefaultStoredHeaders {
		if h.Get(name) != "v-"+name {
			t.Errorf("replay: %s = %q, want it kept", name, h.Get(name))
		}
	}
	if h.Get("X-Not-Kept") != "" || h.Get(idem.ReplayedHeader) != "true" {
		t.Errorf("replay headers %v: X-Not-Kept must not be kept", h)
	}
	// Lease 30s, TTL 24h, HandlerTimeout 1m, the claim-then-complete flow on
	// memstore (the record is in flight while the handler runs), and a 409
	// with Retry-After 30 meanwhile.
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(release) // before the server closes: it waits for the handler
	start := time.Now()
	done := make(chan struct{})
	go func() {
		defer close(done)
		req, _ := http.NewRequest("POST", srv.URL+"/held", nil)
		req.Header.Set("Idempotency-Key", "held")
		resp, err := client.Do(req)
		if err != nil {
			t.Errorf("held request: %v", err)
			return
		}
		resp.Body.Close()
		if resp.StatusCode != 201 {
			t.Errorf("held request: %d", resp.StatusCode)
		}
	}()
	s := <-seenc
	<-entered
	if s.rec == nil || s.rec.State != idem.StateInFlight {
		t.Errorf("while the handler runs the record is %+v, want in flight (claim-then-complete)", s.rec)
	} else {
		if lease := s.rec.LeaseUntil.Sub(s.rec.CreatedAt); lease < 29*time.Second || lease > 31*time.Second {
			t.Errorf("lease %v, want 30s", lease)
		}
		if ttl := s.rec.ExpiresAt.Sub(s.rec.CreatedAt); ttl < 24*time.Hour-time.Second || ttl > 24*time.Hour+time.Second {
			t.Errorf("TTL %v, want 24h", ttl)
		}
	}
	if d := s.deadline.Sub(start); d < 50*time.Second || d > 70*time.Second {
		t.Errorf("the handler's deadline is %v after the request, want 1m (deadline %v)", d, s.deadline)
	}
	st, h, body := do("POST", "/held", "held", "")
	if st != 409 || !strings.Contains(body, idem.CodeKeyInUse) {
		t.Errorf("while in flight: %d %s, want 409", st, body)
	}
	if ra, _ := strconv.Atoi(h.Get("Retry-After")); ra < 28 || ra > 30 {
		t.Errorf("Retry-After %q, want the lease left (30 s)", h.Get("Retry-After"))
	}
	release()
	<-done
}

// fullTimeStore is memstore returning lease deadlines as given, past 2262
// (memstore keeps Unix nanoseconds, saturated there; PostgreSQL's timestamptz
// and MySQL's DATETIME keep them whole).
type fullTimeStore struct {
	*memstore.Store
	mu    sync.Mutex
	lease map[string]time.Time // by token
}

func (s *fullTimeStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	rec, claimed, err := s.Store.Claim(ctx, req)
	s.mu.Lock()
	defer s.mu.Unlock()
	if claimed {
		s.lease[req.Token] = req.LeaseUntil
	} else if rec != nil {
		if l, ok := s.lease[rec.Token]; ok {
			rec.LeaseUntil = l
		}
	}
	return rec, claimed, err
}

// TestLongestLeaseRetryAfter: with the longest Lease a Duration holds, a 409's
// Retry-After is the lease left, not 1: rounding it up to whole seconds
// overflowed (left + 1s - 1ns wrapped negative) and sent clients back at once.
func TestLongestLeaseRetryAfter(t *testing.T) {
	t.Parallel()
	mem := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = mem.Close() })
	store := &fullTimeStore{Store: mem, lease: map[string]time.Time{}}
	mw, err := idem.New(store, &idem.Config{Lease: math.MaxInt64, TTL: math.MaxInt64, HandlerTimeout: math.MaxInt64, CleanupTimeout: math.MaxInt64})
	if err != nil {
		t.Fatal(err)
	}
	gate, entered := make(chan struct{}), make(chan struct{})
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/held" {
			close(entered)
			<-gate
		}
		w.WriteHeader(201)
		_, _ = io.WriteString(w, "done")
	})))
	var once sync.Once
	release := func() { once.Do(func() { close(gate) }) }
	t.Cleanup(srv.Close)
	t.Cleanup(release)
	post := func(path string) (*http.Response, string) {
		req, _ := http.NewRequest("POST", srv.URL+path, strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k"+path[1:])
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			return nil, ""
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	for i := range 2 { // executed, then replayed: nothing overflows on the way
		if resp, body := post("/quick"); resp == nil || resp.StatusCode != 201 || body != "done" || (i == 1) != (resp.Header.Get(idem.ReplayedHeader) == "true") {
			t.Fatalf("request %d under the longest durations: %v %q", i+1, resp, body)
		}
	}
	done := make(chan struct{})
	go func() { defer close(done); post("/held") }()
	<-entered
	resp, body := post("/held")
	if resp == nil || resp.StatusCode != 409 {
		t.Fatalf("while in flight: %v %s, want 409", resp, body)
	}
	if ra, err := strconv.ParseInt(resp.Header.Get("Retry-After"), 10, 64); err != nil || ra < 1<<32 {
		t.Errorf("Retry-After %q under a 292-year lease, want the lease left in seconds", resp.Header.Get("Retry-After"))
	}
	release()
	<-done
}
