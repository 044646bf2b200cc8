package client_test

import (
	"bytes"
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/idemkit/idem/client"
)

// seen is what the fake server saw of one attempt.
type seen struct {
	method string
	keys   []string
	body   string
	length int64
}

// script is a fake Base transport: attempt i gets steps[i] (the last step repeats).
type script struct {
	mu    sync.Mutex
	steps []func(*http.Request) (*http.Response, error)
	seen  []seen
}

func (s *script) RoundTrip(r *http.Request) (*http.Response, error) {
	var body []byte
	if r.Body != nil {
		body, _ = io.ReadAll(r.Body)
		_ = r.Body.Close()
	}
	s.mu.Lock()
	i := len(s.seen)
	s.seen = append(s.seen, seen{method: r.Method, keys: r.Header.Values("Idempotency-Key"), body: string(body), length: r.ContentLength})
	step := s.steps[min(i, len(s.steps)-1)]
	s.mu.Unlock()
	resp, err := step(r)
	if resp != nil {
		resp.Request = r
	}
	return resp, err
}

func (s *script) attempts() []seen {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]seen(nil), s.seen...)
}

func answer(status int, kv ...string) func(*http.Request) (*http.Response, error) {
	return func(*http.Request) (*http.Response, error) {
		h := make(http.Header)
		body := ""
		for i := 0; i+1 < len(kv); i += 2 {
			if kv[i] == "body" {
				body = kv[i+1]
				continue
			}
			h.Add(kv[i], kv[i+1])
		}
		return &http.Response{
			StatusCode: status, Status: fmt.Sprintf("%d %s", status, http.StatusText(status)),
			Header: h, Body: io.NopCloser(strings.NewReader(body)), ContentLength: int64(len(body)),
			ProtoMajor: 1, ProtoMinor: 1,
		}, nil
	}
}

func fail(err error) func(*http.Request) (*http.Response, error) {
	return func(*http.Request) (*http.Response, error) { return nil, err }
}

func problemAnswer(status int, code string, kv ...string) func(*http.Request) (*http.Response, error) {
	body := fmt.Sprintf(`{"type":"https://example.com/#%s","title":"t","status":%d,"detail":"detail of %s","code":%q}`, code, status, code, code)
	return answer(status, append([]string{"Content-Type", "application/problem+json", "body", body}, kv...)...)
}

// fast is a Transport that does not wait long between attempts.
func fast(base http.RoundTripper, attempts int) *client.Transport {
	return &client.Transport{Base: base, MaxAttempts: attempts, MinBackoff: time.Millisecond, MaxBackoff: 5 * time.Millisecond}
}

func post(t *testing.T, ctx context.Context, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://orders.test/orders", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

func TestRetryPolicyByStatus(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name  string
		step  func(*http.Request) (*http.Response, error)
		retry bool
		code  string
	}{
		{"200", answer(200, "body", "ok"), false, ""},
		{"201", answer(201, "body", "created"), false, ""},
		{"400", problemAnswer(400, "idempotency_key_invalid"), false, ""},
		{"404", answer(404), false, ""},
		{"409 business conflict", problemAnswer(409, "order_exists"), false, ""},
		{"409 plain", answer(409, "body", "conflict"), false, ""},
		{"409 in flight", problemAnswer(409, "idempotency_key_in_use"), true, "idempotency_key_in_use"},
		{"409 lease lost", problemAnswer(409, "idempotency_lease_lost"), true, "idempotency_lease_lost"},
		{"409 with Retry-After", answer(409, "Retry-After", "0"), true, ""},
		{"413", problemAnswer(413, "idempotency_body_too_large"), false, ""},
		{"422", problemAnswer(422, "idempotency_key_reused"), false, ""},
		{"429", answer(429, "Retry-After", "0"), true, ""},
		{"500", problemAnswer(500, "idempotency_replay_failed"), false, ""},
		{"501", answer(501), false, ""},
		{"502", answer(502), true, ""},
		{"503", problemAnswer(503, "idempotency_store_unavailable"), true, "idempotency_store_unavailable"},
		{"504", answer(504), true, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			base := &script{steps: []func(*http.Request) (*http.Response, error){c.step}}
			resp, err := fast(base, 3).RoundTrip(post(t, context.Background(), `{"cart":"c1"}`))
			n := len(base.attempts())
			if !c.retry {
				if err != nil {
					t.Fatalf("final answer came back as an error: %v", err)
				}
				if n != 1 || client.Attempts(resp) != 1 {
					t.Fatalf("%d attempts (Attempts(resp) = %d); a final answer must not be retried", n, client.Attempts(resp))
				}
				// The answer's body is intact even when the Transport peeked at it.
				want, _ := io.ReadAll(mustStep(t, c.step).Body)
				got, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if !bytes.Equal(got, want) {
					t.Fatalf("body = %q, want %q", got, want)
				}
				return
			}
			var re *client.RetryError
			if !errors.As(err, &re) {
				t.Fatalf("retryable answer exhausted: got resp %v, err %v; want a *RetryError", resp, err)
			}
			if n != 3 || re.Attempts != 3 {
				t.Fatalf("%d attempts (RetryError.Attempts = %d), want 3", n, re.Attempts)
			}
			status := mustStep(t, c.step).StatusCode
			if re.Status != status || re.Code != c.code || re.Err != nil || re.Stop != nil {
				t.Fatalf("RetryError = %+v; want Status %d, Code %q, no Err or Stop", re, status, c.code)
			}
			if c.code != "" && re.Detail != "detail of "+c.code {
				t.Fatalf("Detail = %q", re.Detail)
			}
		})
	}
}

func mustStep(t *testing.T, step func(*http.Request) (*http.Response, error)) *http.Response {
	t.Helper()
	resp, err := step(nil)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func TestRetriesUntilSuccess(t *testing.T) {
	t.Parallel()
	base := &script{steps: []func(*http.Request) (*http.Response, error){
		fail(fmt.Errorf("read tcp: %w", syscall.ECONNRESET)),
		fail(io.ErrUnexpectedEOF),
		problemAnswer(409, "idempotency_key_in_use", "Retry-After", "0"),
		answer(503),
		answer(201, "Idempotent-Replayed", "true", "body", "created"),
	}}
	resp, err := fast(base, 5).RoundTrip(post(t, context.Background(), "x"))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if got := client.Attempts(resp); got != 5 || len(base.attempts()) != 5 {
		t.Fatalf("Attempts(resp) = %d, base saw %d; want 5", got, len(base.attempts()))
	}
	if !client.Replayed(resp) {
		t.Fatal("Replayed(resp) = false for an answer with Idempotent-Replayed: true")
	}
}

func TestSameKeyEveryAttemptNewKeyPerOperation(t *testing.T) {
	t.Parallel()
	base := &script{steps: []func(*http.Request) (*http.Response, error){answer(503), answer(503), answer(201)}}
	tr := fast(base, 5)
	keys := map[string]bool{}
	for op := range 3 {
		before := len(base.attempts())
		resp, err := tr.RoundTrip(post(t, context.Background(), "same body every time"))
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		atts := base.attempts()[before:]
		if op == 0 && len(atts) != 3 {
			t.Fatalf("first operation: %d attempts, want 3", len(atts))
		}
		key := ""
		for i, a := range atts {
			if len(a.keys) != 1 {
				t.Fatalf("operation %d attempt %d sent %d key headers, want 1", op, i+1, len(a.keys))
			}
			if i == 0 {
				key = a.keys[0]
			} else if a.keys[0] != key {
				t.Fatalf("operation %d: attempt %d sent key %q, attempt 1 sent %q; a retry must send the same key", op, i+1, a.keys[0], key)
			}
		}
		if u, err := uuid.Parse(key); err != nil || u.Version() != 4 {
			t.Fatalf("default key %q is not a UUID v4 (%v)", key, err)
		}
		if keys[key] {
			t.Fatalf("operation %d reused key %q of an earlier operation with the same body", op, key)
		}
		keys[key] = true
	}
}

func TestCallerKeys(t *testing.T) {
	t.Parallel()
	t.Run("header kept as is", func(t *testing.T) {
		t.Parallel()
		base := &script{steps: []func(*http.Request) (*http.Response, error){answer(502), answer(200)}}
		req := post(t, client.WithKey(context.Background(), "ignored"), "b")
		req.Header.Set("Idempotency-Key", `"cart-42"`)
		resp, err := fast(base, 3).RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		for i, a := range base.attempts() {
			if len(a.keys) != 1 || a.keys[0] != `"cart-42"` {
				t.Fatalf("attempt %d sent keys %q, want the caller's header as is", i+1, a.keys)
			}
		}
		if got := req.Header.Get("Idempotency-Key"); got != `"cart-42"` {
			t.Fatalf("the caller's request was modified: %q", got)
		}
	})
	t.Run("WithKey", func(t *testing.T) {
		t.Parallel()
		base := &script{steps: []func(*http.Request) (*http.Response, error){answer(502), answer(200)}}
		tr := fast(base, 3)
		tr.KeyFunc = func() string { t.Error("KeyFunc called although the context carries a key"); return "x" }
		req := post(t, client.WithKey(context.Background(), "cart-7"), "b")
		resp, err := tr.RoundTrip(req)
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if len(base.attempts()) != 2 {
			t.Fatalf("%d attempts, want 2", len(base.attempts()))
		}
		for i, a := range base.attempts() {
			if len(a.keys) != 1 || a.keys[0] != "cart-7" {
				t.Fatalf("attempt %d sent keys %q, want [cart-7]", i+1, a.keys)
			}
		}
		if req.Header.Get("Idempotency-Key") != "" {
			t.Fatal("RoundTrip set a header on the caller's request")
		}
	})
	t.Run("custom header and KeyFunc", func(t *testing.T) {
		t.Parallel()
		var got []string
		base := &script{steps: []func(*http.Request) (*http.Response, error){func(r *http.Request) (*http.Response, error) {
			got = append(got, r.Header.Get("X-Op-Key"))
			return answer(200)(r)
		}}}
		tr := fast(base, 3)
		tr.HeaderName, tr.KeyFunc = "X-Op-Key", func() string { return "k1" }
		resp, err := tr.RoundTrip(post(t, context.Background(), ""))
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if len(got) != 1 || got[0] != "k1" || len(base.attempts()[0].keys) != 0 {
			t.Fatalf("X-Op-Key = %q, Idempotency-Key = %q", got, base.attempts()[0].keys)
		}
	})
}

func TestUnkeyedMethodsUntouched(t *testing.T) {
	t.Parallel()
	for _, method := range []string{http.MethodGet, http.MethodHead, http.MethodPut, http.MethodDelete, http.MethodOptions} {
		base := &script{steps: []func(*http.Request) (*http.Response, error){answer(503, "Retry-After", "0")}}
		req, _ := http.NewRequestWithContext(client.WithKey(context.Background(), "k"), method, "http://orders.test/orders/1", nil)
		resp, err := fast(base, 5).RoundTrip(req)
		if err != nil {
			t.Fatalf("%s: %v", method, err)
		}
		_ = resp.Body.Close()
		if n := len(base.attempts()); n != 1 {
			t.Errorf("%s: %d attempts, want 1 (only keyed methods are retried)", method, n)
		}
		if k := base.attempts()[0].keys; len(k) != 0 {
			t.Errorf("%s: sent key %q; only keyed methods get one", method, k)
		}
		if resp.StatusCode != 503 || client.Attempts(resp) != 0 {
			t.Errorf("%s: status %d, Attempts %d; want the answer untouched", method, resp.StatusCode, client.Attempts(resp))
		}
	}
	// PATCH is keyed by default; PUT is when Methods says so.
	base := &script{steps: []func(*http.Request) (*http.Response, error){answer(503), answer(200)}}
	tr := fast(base, 5)
	tr.Methods = []string{"put"}
	req, _ := http.NewRequest(http.MethodPut, "http://orders.test/orders/1", strings.NewReader("x"))
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if a := base.attempts(); len(a) != 2 || len(a[0].keys) != 1 || a[0].keys[0] != a[1].keys[0] {
		t.Fatalf("PUT with Methods [put]: attempts %+v", a)
	}
}

// hiddenReader hides its type from http.NewRequest, which then sets no GetBody.
type hiddenReader struct{ io.Reader }

func TestBodyRewound(t *testing.T) {
	t.Parallel()
	const body = `{"cart_id":"c-1","items":[1,2,3]}`
	for name, r := range map[string]io.Reader{
		"GetBody":    strings.NewReader(body),
		"no GetBody": hiddenReader{strings.NewReader(body)},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			base := &script{steps: []func(*http.Request) (*http.Response, error){fail(io.EOF), answer(502), answer(201)}}
			req, _ := http.NewRequest(http.MethodPost, "http://orders.test/orders", r)
			if (req.GetBody != nil) != (name == "GetBody") {
				t.Fatalf("test setup: GetBody set = %v", req.GetBody != nil)
			}
			resp, err := fast(base, 5).RoundTrip(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			atts := base.attempts()
			if len(atts) != 3 {
				t.Fatalf("%d attempts, want 3", len(atts))
			}
			for i, a := range atts {
				if a.body != body {
					t.Fatalf("attempt %d sent body %q, want %q", i+1, a.body, body)
				}
				if a.length != int64(len(body)) {
					t.Fatalf("attempt %d: ContentLength %d for a %d-byte body", i+1, a.length, len(body))
				}
			}
		})
	}
}

func TestContextCancelStopsAtOnce(t *testing.T) {
	t.Parallel()
	base := &script{steps: []func(*http.Request) (*http.Response, error){answer(503, "Retry-After", "30")}}
	tr := &client.Transport{Base: base, MaxAttempts: 10, MinBackoff: 30 * time.Second, MaxBackoff: 30 * time.Second, MaxRetryAfter: time.Minute}
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(200*time.Millisecond, cancel)
	start := time.Now()
	resp, err := tr.RoundTrip(post(t, ctx, "x"))
	took := time.Since(start)
	if resp != nil {
		t.Fatalf("got a response %d after cancellation", resp.StatusCode)
	}
	if took > 5*time.Second {
		t.Fatalf("RoundTrip took %v to notice cancellation during a 30s wait", took)
	}
	var re *client.RetryError
	if !errors.As(err, &re) || !errors.Is(err, context.Canceled) || re.Attempts != 1 || re.Status != 503 {
		t.Fatalf("err = %v (%+v); want a RetryError after 1 attempt, Is context.Canceled", err, re)
	}
	if re.RetryAfter != 30*time.Second {
		t.Fatalf("RetryAfter = %v, want 30s", re.RetryAfter)
	}
	if len(base.attempts()) != 1 {
		t.Fatalf("%d attempts after cancellation", len(base.attempts()))
	}
}

func TestDeadlineIsNotSleptThrough(t *testing.T) {
	t.Parallel()
	for _, ra := range []string{"10", time.Now().Add(20 * time.Second).UTC().Format(http.TimeFormat)} {
		base := &script{steps: []func(*http.Request) (*http.Response, error){answer(429, "Retry-After", ra)}}
		tr := &client.Transport{Base: base, MaxAttempts: 10}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		start := time.Now()
		_, err := tr.RoundTrip(post(t, ctx, "x"))
		took := time.Since(start)
		cancel()
		var re *client.RetryError
		if !errors.As(err, &re) || !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Retry-After %s: err = %v; want a RetryError that Is context.DeadlineExceeded", ra, err)
		}
		if took > 3*time.Second || re.Attempts != 1 {
			t.Fatalf("Retry-After %s past the deadline: slept %v over %d attempts instead of giving up at once", ra, took, re.Attempts)
		}
	}
}

func TestRetryAfterHonoured(t *testing.T) {
	t.Parallel()
	cases := map[string]func() string{
		"seconds":   func() string { return "1" },
		"HTTP-date": func() string { return time.Now().Add(2 * time.Second).UTC().Format(http.TimeFormat) },
	}
	for name, ra := range cases {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			base := &script{steps: []func(*http.Request) (*http.Response, error){
				func(r *http.Request) (*http.Response, error) { return answer(503, "Retry-After", ra())(r) },
				answer(200),
			}}
			start := time.Now()
			resp, err := fast(base, 3).RoundTrip(post(t, context.Background(), "x"))
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			// The backoff alone is at most 5ms; only Retry-After explains a wait of
			// most of a second. (An HTTP-date has whole seconds, so 2s ahead is >1s.)
			if took := time.Since(start); took < 900*time.Millisecond {
				t.Fatalf("retried after %v; Retry-After asked for about a second or more", took)
			}
		})
	}
	t.Run("capped", func(t *testing.T) {
		t.Parallel()
		base := &script{steps: []func(*http.Request) (*http.Response, error){answer(503, "Retry-After", "3600"), answer(200)}}
		tr := fast(base, 3)
		tr.MaxRetryAfter = 50 * time.Millisecond
		start := time.Now()
		resp, err := tr.RoundTrip(post(t, context.Background(), "x"))
		if err != nil {
			t.Fatal(err)
		}
		_ = resp.Body.Close()
		if took := time.Since(start); took > 10*time.Second {
			t.Fatalf("waited %v; Retry-After: 3600 should be capped at 50ms", took)
		}
	})
}

func TestTransportErrors(t *testing.T) {
	t.Parallel()
	t.Run("exhausted", func(t *testing.T) {
		t.Parallel()
		reset := fmt.Errorf("read tcp 127.0.0.1:1->127.0.0.1:2: %w", syscall.ECONNRESET)
		base := &script{steps: []func(*http.Request) (*http.Response, error){fail(reset)}}
		req := post(t, client.WithKey(context.Background(), "op-1"), "x")
		_, err := fast(base, 4).RoundTrip(req)
		var re *client.RetryError
		if !errors.As(err, &re) {
			t.Fatalf("err = %v, want a *RetryError", err)
		}
		if re.Attempts != 4 || re.Status != 0 || re.Key != "op-1" || !errors.Is(err, syscall.ECONNRESET) || re.Stop != nil {
			t.Fatalf("RetryError = %+v", re)
		}
		msg := err.Error()
		for _, want := range []string{"4 attempts", `"op-1"`, "same body and key", "connection reset"} {
			if !strings.Contains(msg, want) {
				t.Errorf("error %q does not say %q", msg, want)
			}
		}
	})
	t.Run("not retryable", func(t *testing.T) {
		t.Parallel()
		base := &script{steps: []func(*http.Request) (*http.Response, error){fail(x509.UnknownAuthorityError{})}}
		_, err := fast(base, 4).RoundTrip(post(t, context.Background(), "x"))
		var re *client.RetryError
		if !errors.As(err, &re) || re.Attempts != 1 || len(base.attempts()) != 1 {
			t.Fatalf("certificate error: err = %v, %d attempts; want one attempt", err, len(base.attempts()))
		}
	})
	t.Run("attempt timeout", func(t *testing.T) {
		t.Parallel()
		hang := func(r *http.Request) (*http.Response, error) {
			<-r.Context().Done()
			return nil, r.Context().Err()
		}
		base := &script{steps: []func(*http.Request) (*http.Response, error){hang, answer(201, "body", "ok")}}
		tr := fast(base, 3)
		tr.AttemptTimeout = 100 * time.Millisecond
		resp, err := tr.RoundTrip(post(t, context.Background(), "x"))
		if err != nil {
			t.Fatal(err)
		}
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if err != nil || string(b) != "ok" || client.Attempts(resp) != 2 {
			t.Fatalf("body %q (%v), Attempts %d; want ok after 2 attempts", b, err, client.Attempts(resp))
		}
	})
}

func TestReplayed(t *testing.T) {
	t.Parallel()
	for v, want := range map[string]bool{"true": true, "True": true, "": false, "false": false, "1": false} {
		resp := &http.Response{Header: http.Header{}}
		if v != "" {
			resp.Header.Set("Idempotent-Replayed", v)
		}
		if got := client.Replayed(resp); got != want {
			t.Errorf("Replayed with %q = %v", v, got)
		}
	}
	if client.Replayed(nil) || client.Attempts(nil) != 0 {
		t.Error("nil response")
	}
}

// TestAttemptTimeoutRealSocket: a server that takes the request and never answers
// (a black-holed answer). Each attempt is abandoned after AttemptTimeout and the
// operation ends with a RetryError once the attempts run out.
func TestAttemptTimeoutRealSocket(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var accepted atomic.Int64
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			defer c.Close()
			go func() { _, _ = io.Copy(io.Discard, c) }() // read, never answer
		}
	}()
	tr := fast(&http.Transport{DisableKeepAlives: true}, 3)
	tr.AttemptTimeout = 200 * time.Millisecond
	req, _ := http.NewRequest(http.MethodPost, "http://"+ln.Addr().String()+"/orders", strings.NewReader("x"))
	start := time.Now()
	_, err = tr.RoundTrip(req)
	var re *client.RetryError
	if !errors.As(err, &re) || re.Attempts != 3 || re.Stop != nil || !errors.Is(err, client.ErrAttemptTimeout) || !strings.Contains(err.Error(), "attempt timed out after 200ms") {
		t.Fatalf("err = %v; want a RetryError after 3 timed-out attempts", err)
	}
	if took := time.Since(start); took > 20*time.Second {
		t.Fatalf("3 attempts of 200ms took %v", took)
	}
	for wait := time.Now().Add(10 * time.Second); accepted.Load() < 3 && time.Now().Before(wait); {
		time.Sleep(10 * time.Millisecond) // the accept loop may lag on a loaded machine
	}
	if got := accepted.Load(); got != 3 {
		t.Fatalf("the server accepted %d connections, want 3 (one per attempt)", got)
	}
}
