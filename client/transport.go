package client

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

// Defaults for Transport fields left at their zero value.
const (
	DefaultHeaderName    = idem.DefaultHeaderName
	DefaultMaxAttempts   = 5
	DefaultMinBackoff    = 100 * time.Millisecond
	DefaultMaxBackoff    = 10 * time.Second
	DefaultMaxRetryAfter = 30 * time.Second
)

// DefaultMethods are the methods the Transport keys and retries unless
// Transport.Methods says otherwise. They match the server's default.
var DefaultMethods = []string{http.MethodPost, http.MethodPatch}

// Transport is an http.RoundTripper that sends every request of a keyed method
// (POST and PATCH by default) with an idempotency key and retries it when that is
// safe. Each call to RoundTrip is one operation with one key: the key is made
// before the first attempt and sent, unchanged, with every retry. Requests of other
// methods are passed to Base untouched and are not retried.
//
// Which key: an Idempotency-Key header the caller already set is kept as it is;
// otherwise the key stored in the request context with WithKey; otherwise a new
// one from KeyFunc.
//
// What is retried: connection errors and attempt timeouts (also when the request
// was sent and the answer lost — the server's idempotency makes the resend safe),
// 409 answers that say the key is in flight (problem code idempotency_key_in_use
// or idempotency_lease_lost, or any 409 with Retry-After), 429, 502, 503 and 504.
// Retry-After is honoured in both forms (seconds and HTTP-date), capped at
// MaxRetryAfter; otherwise the wait is capped exponential backoff with full
// jitter. Never retried: 400, 422, every other 4xx, 500, 501 and every other
// status — they are returned as responses — nor errors that a resend cannot fix
// (TLS certificate errors, an unsupported URL scheme, a request body whose reader
// fails, with or without GetBody: ErrBodyUnreadable).
//
// The body of an answer that may be retried is read (64 KiB at most) within
// AttemptTimeout, or MaxRetryBodyWait when that is 0; an answer whose body
// stalls longer is abandoned — its connection closed — and retried.
//
// Retries stop after MaxAttempts, at once when the request context is cancelled,
// and before a wait that would end after the context's deadline. Then RoundTrip
// returns a *RetryError. The request body is sent again for every attempt, from
// req.GetBody when set (http.NewRequest sets it for in-memory bodies), otherwise
// from a copy read into memory before the first attempt.
//
// The zero Transport is ready to use. A Transport is safe for concurrent use; do
// not change its fields after its first use. Invalid fields make RoundTrip return an
// error that says which.
type Transport struct {
	// Base sends each attempt. Defaults to http.DefaultTransport.
	//
	// net/http's Transport silently re-sends a request that carries an
	// Idempotency-Key header when a reused keep-alive connection drops before the
	// answer; such invisible resends are safe against an idem server but are not
	// counted by Attempts.
	Base http.RoundTripper

	// MaxAttempts is the most attempts made for one operation, the first included;
	// 1 disables retries (useful under another retrying client). Defaults to 5.
	MaxAttempts int

	// MinBackoff is the backoff base: before retry n (n = 0 for the first retry) the
	// Transport waits a random duration in [0, min(MaxBackoff, MinBackoff·2^n)]
	// ("full jitter"), unless the answer carried Retry-After. Defaults to 100ms.
	MinBackoff time.Duration

	// MaxBackoff caps the backoff. Defaults to 10s, or MinBackoff if that is larger.
	MaxBackoff time.Duration

	// MaxRetryAfter caps the wait a Retry-After header asks for; a longer request is
	// shortened to it. Defaults to 30s.
	MaxRetryAfter time.Duration

	// AttemptTimeout bounds each attempt until its response headers arrive; an
	// attempt that takes longer is abandoned and retried (the request may have been
	// carried out; the retry will learn its outcome). It also bounds, afresh from
	// the headers, the reading of the body of an answer that may be retried (409,
	// 429, 502, 503, 504). Zero means no limit beyond the request context for the
	// headers, and MaxRetryBodyWait for such a body. The body of a final answer
	// is the caller's to read: bound it with the request context. Defaults to 0.
	AttemptTimeout time.Duration

	// KeyFunc makes the key of an operation that brings none. Keys must be unique
	// per operation, never derived from the body, and hold nothing personal.
	// Defaults to NewKey (a random UUID v4).
	KeyFunc func() string

	// Methods are the request methods that are keyed and retried; others pass
	// through untouched. Defaults to DefaultMethods (POST and PATCH).
	Methods []string

	// HeaderName is the request header that carries the key.
	// Defaults to "Idempotency-Key".
	HeaderName string

	// Rand is the source of backoff jitter, for reproducible tests; the Transport
	// serializes its calls. Defaults to the math/rand/v2 global generator.
	Rand rand.Source

	mu sync.Mutex // serializes Rand
}

// New returns an *http.Client whose Transport is t; a nil t means a Transport with
// all defaults. The client sets no overall Timeout: bound an operation, retries
// included, with the request context's deadline.
func New(t *Transport) *http.Client {
	if t == nil {
		t = &Transport{}
	}
	return &http.Client{Transport: t}
}

var _ http.RoundTripper = (*Transport)(nil)

// settings are a Transport's fields with defaults applied.
type settings struct {
	base           http.RoundTripper
	maxAttempts    int
	minBackoff     time.Duration
	maxBackoff     time.Duration
	maxRetryAfter  time.Duration
	attemptTimeout time.Duration
	keyFunc        func() string
	methods        []string
	header         string
}

func (t *Transport) settings() (*settings, error) {
	s := &settings{
		base: t.Base, maxAttempts: t.MaxAttempts, minBackoff: t.MinBackoff,
		maxBackoff: t.MaxBackoff, maxRetryAfter: t.MaxRetryAfter,
		attemptTimeout: t.AttemptTimeout, keyFunc: t.KeyFunc, methods: t.Methods,
		header: t.HeaderName,
	}
	var errs []error
	if s.base == nil {
		s.base = http.DefaultTransport
	}
	if s.maxAttempts == 0 {
		s.maxAttempts = DefaultMaxAttempts
	} else if s.maxAttempts < 0 {
		errs = append(errs, fmt.Errorf("MaxAttempts is %d; use 1 or more (1 disables retries), or 0 for the default %d", s.maxAttempts, DefaultMaxAttempts))
	}
	if s.minBackoff == 0 {
		s.minBackoff = DefaultMinBackoff
	} else if s.minBackoff < 0 {
		errs = append(errs, fmt.Errorf("MinBackoff is %v; use a positive duration or 0 for the default %v", s.minBackoff, DefaultMinBackoff))
	}
	if s.maxBackoff == 0 {
		s.maxBackoff = max(DefaultMaxBackoff, s.minBackoff)
	} else if s.maxBackoff < s.minBackoff {
		errs = append(errs, fmt.Errorf("MaxBackoff (%v) is less than MinBackoff (%v); raise it, or leave it 0 for the default", s.maxBackoff, s.minBackoff))
	}
	if s.maxRetryAfter == 0 {
		s.maxRetryAfter = DefaultMaxRetryAfter
	} else if s.maxRetryAfter < 0 {
		errs = append(errs, fmt.Errorf("MaxRetryAfter is %v; use a positive duration or 0 for the default %v", s.maxRetryAfter, DefaultMaxRetryAfter))
	}
	if s.attemptTimeout < 0 {
		errs = append(errs, fmt.Errorf("AttemptTimeout is %v; use a positive duration, or 0 for no limit", s.attemptTimeout))
	}
	if s.keyFunc == nil {
		s.keyFunc = NewKey
	}
	if len(s.methods) == 0 {
		s.methods = DefaultMethods
	}
	if s.header == "" {
		s.header = DefaultHeaderName
	} else if strings.ContainsAny(s.header, " \t\r\n:") {
		errs = append(errs, fmt.Errorf("HeaderName %q is not a header name; leave it empty for %q", s.header, DefaultHeaderName))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("idem/client: invalid Transport: %w", errors.Join(errs...))
	}
	return s, nil
}

func (s *settings) keyed(method string) bool {
	for _, m := range s.methods {
		if strings.EqualFold(m, method) {
			return true
		}
	}
	return false
}

// headerValues returns the values of the header name in h, also when the
// caller put them under a spelling that is not canonical
// (h["idempotency-key"]): net/http sends such a key as it is, so a key of our
// own beside it would be a second key header line.
func headerValues(h http.Header, name string) []string {
	if vs := h.Values(name); len(vs) > 0 {
		return vs
	}
	for k, vs := range h {
		if len(vs) > 0 && strings.EqualFold(k, name) {
			return vs
		}
	}
	return nil
}

// ErrAttemptTimeout is wrapped by the error of an attempt abandoned after
// Transport.AttemptTimeout, or because the body of an answer to retry stalled
// (RetryError.Err); check it with errors.Is.
var ErrAttemptTimeout = errors.New("idem/client: attempt timed out")

// ErrBodyUnreadable is wrapped, together with the reader's own error, by the
// error of an attempt whose request body failed to read (RetryError.Err). Such
// an attempt is not retried: the request never reached the server whole, so
// nothing was carried out, and a resend — even from req.GetBody — would read
// the same broken source.
var ErrBodyUnreadable = errors.New("idem/client: reading the request body failed")

// MaxRetryBodyWait bounds the wait for the body of an answer that may be
// retried (409, 429, 502, 503, 504) when Transport.AttemptTimeout is 0: the
// Transport reads up to 64 KiB of it for the problem code and to reuse the
// connection, and abandons the attempt, and retries, when that takes longer.
const MaxRetryBodyWait = 5 * time.Second

// RoundTrip sends req as one operation: with one idempotency key, and as many
// attempts as it takes to get a final answer, within MaxAttempts and the request
// context. See Transport for what is retried. The response of the last attempt is
// returned as it is; Attempts(resp) reports how many attempts were made and
// Replayed(resp) whether the answer was a replay. When no attempt got a final
// answer, RoundTrip returns a *RetryError.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	s, err := t.settings()
	if err != nil {
		closeBody(req)
		return nil, err
	}
	if !s.keyed(req.Method) {
		return s.base.RoundTrip(req)
	}
	ctx := req.Context()

	header := req.Header.Clone()
	if header == nil {
		header = make(http.Header)
	}
	var key string
	if vs := headerValues(req.Header, s.header); len(vs) > 0 {
		key = vs[0] // the caller's key, sent as it is
	} else {
		k, ok := KeyFrom(ctx)
		if !ok || k == "" {
			k = s.keyFunc()
		}
		if k == "" {
			closeBody(req)
			return nil, errors.New("idem/client: KeyFunc returned an empty key; return a new unique key (a UUID) for every call")
		}
		key = k
		header.Set(s.header, key)
	}

	bodies, err := newBodies(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("idem/client: reading the request body, to be able to resend it, failed before the first attempt (nothing was sent): %w", err)
	}

	rerr := &RetryError{Key: key}
	for attempt := 1; ; attempt++ {
		areq := req.WithContext(context.WithValue(ctx, attemptCtx{}, attempt))
		areq.Header = header.Clone()
		first, err := bodies.next(attempt)
		if err != nil {
			rerr.Err = fmt.Errorf("rewinding the request body for attempt %d (req.GetBody failed): %w", attempt, err)
			rerr.Status, rerr.Code, rerr.Detail, rerr.RetryAfter = 0, "", "", 0
			return nil, rerr
		}
		var body *watchedBody
		if first != nil && first != http.NoBody {
			body = &watchedBody{rc: first}
			areq.Body = body
		} else {
			areq.Body = first
		}
		if bodies.getBody != nil {
			areq.GetBody = bodies.getBody
			areq.ContentLength = bodies.length
		}
		// Every attempt has its own context, so that it can be abandoned: after
		// AttemptTimeout, or when the body of an answer to retry stalls.
		actx, cancel := context.WithCancelCause(areq.Context())
		areq = areq.WithContext(actx)
		var timer *time.Timer
		if s.attemptTimeout > 0 {
			timer = time.AfterFunc(s.attemptTimeout, func() { cancel(ErrAttemptTimeout) })
		}
		resp, err := s.base.RoundTrip(areq)
		timedOut := false
		if timer != nil {
			timedOut = !timer.Stop()
			if timedOut && err == nil {
				// The answer came just as the attempt timed out: its body is already
				// cut off by the cancelled context, so the attempt counts as failed.
				abandon(resp.Body)
				resp, err = nil, context.Cause(areq.Context())
			}
		}
		rerr.Attempts = attempt

		var wait time.Duration
		if err != nil {
			cancel(nil)
			rerr.Status, rerr.Code, rerr.Detail, rerr.RetryAfter = 0, "", "", 0
			rerr.Err = err
			if ctx.Err() != nil {
				rerr.Stop = ctx.Err()
				return nil, rerr
			}
			if berr := body.failure(); berr != nil && !timedOut {
				// The caller's body failed: the request never reached the server
				// whole, and a resend would read the same broken source.
				rerr.Err = fmt.Errorf("%w on attempt %d (nothing complete was sent; fix the body's reader): %w", ErrBodyUnreadable, attempt, berr)
				return nil, rerr
			}
			if timedOut {
				rerr.Err = fmt.Errorf("%w after %v (the request may have been carried out): %w", ErrAttemptTimeout, s.attemptTimeout, err)
			} else if !retryableErr(err) {
				return nil, rerr
			}
			wait = t.backoff(s, attempt-1)
		} else {
			if resp.Request == nil {
				resp.Request = areq
			}
			if !maybeRetryable(resp.StatusCode) {
				resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
				return resp, nil
			}
			bound := s.attemptTimeout
			if bound == 0 {
				bound = MaxRetryBodyWait
			}
			retry, p, stalled := judgeBounded(resp, bound, cancel)
			rerr.Status, rerr.Code, rerr.Detail = resp.StatusCode, p.Code, p.Detail
			ra, ok := parseRetryAfter(resp.Header.Get("Retry-After"), time.Now())
			rerr.RetryAfter = ra
			switch {
			case stalled:
				rerr.Err = fmt.Errorf("%w: the body of a %d answer did not arrive within %v (the attempt was abandoned)", ErrAttemptTimeout, resp.StatusCode, bound)
				if ctx.Err() != nil {
					rerr.Stop = ctx.Err()
					return nil, rerr
				}
			case !retry:
				resp.Body = &cancelOnClose{ReadCloser: resp.Body, cancel: cancel}
				return resp, nil
			default:
				cancel(nil)
				rerr.Err = nil
			}
			if ok && ra > 0 {
				wait = min(ra, s.maxRetryAfter)
			} else {
				wait = t.backoff(s, attempt-1)
			}
		}

		if attempt >= s.maxAttempts {
			return nil, rerr
		}
		if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= wait {
			// The wait would end past the deadline: give up now instead of sleeping
			// through the caller's whole budget for nothing.
			rerr.Stop = context.DeadlineExceeded
			return nil, rerr
		}
		if err := sleep(ctx, wait); err != nil {
			rerr.Stop = err
			return nil, rerr
		}
	}
}

// judgeBounded decides whether resp, an answer of a status that may be retried,
// is to be retried, reading at most maxProblemBody of its body for the problem
// code and draining what is left of a retried answer. The reading runs on its
// own goroutine and may take at most bound: a body that stalls longer is
// abandoned (the attempt's context is cancelled with ErrAttemptTimeout, which
// makes net/http close the connection, and the body is closed) and stalled is
// true; the answer is then to be retried whatever its status, as the server's
// idempotency makes that safe.
func judgeBounded(resp *http.Response, bound time.Duration, cancel context.CancelCauseFunc) (retry bool, p problem, stalled bool) {
	type verdict struct {
		retry bool
		p     problem
	}
	body := resp.Body
	done := make(chan verdict, 1)
	go func() {
		r, p := retryableResponse(resp)
		if r {
			drainClose(resp.Body)
		}
		done <- verdict{r, p}
	}()
	tm := time.NewTimer(bound)
	defer tm.Stop()
	select {
	case v := <-done:
		return v.retry, v.p, false
	case <-tm.C:
		cancel(ErrAttemptTimeout)
		abandon(body)
		return true, problem{}, true
	}
}

// abandon closes body without waiting for it: a body that ignores its
// cancelled context must not hold the caller.
func abandon(body io.ReadCloser) {
	go func() { _ = body.Close() }()
}

// backoff returns the full-jitter wait before retry n (0 for the first retry): a
// random duration in [0, min(maxBackoff, minBackoff·2^n)].
func (t *Transport) backoff(s *settings, n int) time.Duration {
	return t.jitter(backoffCeiling(s.minBackoff, s.maxBackoff, n))
}

// backoffCeiling returns min(maxB, minB·2^n) without overflowing.
func backoffCeiling(minB, maxB time.Duration, n int) time.Duration {
	if n < 0 {
		n = 0
	}
	if n >= 62 || minB > maxB>>n {
		return maxB
	}
	return minB << n
}

// jitter returns a random duration in [0, ceil].
func (t *Transport) jitter(ceil time.Duration) time.Duration {
	if ceil <= 0 {
		return 0
	}
	if t.Rand == nil {
		return time.Duration(rand.Uint64N(uint64(ceil) + 1))
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return time.Duration(rand.New(t.Rand).Uint64N(uint64(ceil) + 1))
}

// sleep waits for d, or until ctx ends, returning ctx's error then.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// bodies hands out the request body for each attempt.
type bodies struct {
	first   io.ReadCloser
	getBody func() (io.ReadCloser, error) // nil when there is no body
	length  int64
}

// newBodies prepares to resend req's body: from req.GetBody when set, otherwise
// from a copy read now. It closes req.Body when it reads it. The copy ends with
// ctx: a reader that stalls (a pipe, a socket) must not hold the caller past its
// deadline; req.Body is closed then, to end the read.
func newBodies(ctx context.Context, req *http.Request) (*bodies, error) {
	b := &bodies{first: req.Body, length: req.ContentLength}
	if req.Body == nil || req.Body == http.NoBody {
		return b, nil
	}
	if req.GetBody != nil {
		b.getBody = req.GetBody
		return b, nil
	}
	type copied struct {
		data []byte
		err  error
	}
	done := make(chan copied, 1)
	go func() {
		data, err := io.ReadAll(req.Body)
		done <- copied{data, err}
	}()
	var data []byte
	select {
	case c := <-done:
		_ = req.Body.Close()
		if c.err != nil {
			return nil, c.err
		}
		data = c.data
	case <-ctx.Done():
		_ = req.Body.Close()
		return nil, context.Cause(ctx)
	}
	b.getBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(data)), nil }
	b.first, _ = b.getBody()
	b.length = int64(len(data))
	return b, nil
}

func (b *bodies) next(attempt int) (io.ReadCloser, error) {
	if attempt == 1 || b.getBody == nil {
		return b.first, nil
	}
	return b.getBody()
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// drainClose reads a little of body, so that the connection can be reused, and
// closes it.
func drainClose(body io.ReadCloser) {
	_, _ = io.CopyN(io.Discard, body, 64<<10)
	_ = body.Close()
}

// watchedBody is the request body of one attempt; it notes the first read
// error of the caller's reader, which Base may see on another goroutine.
type watchedBody struct {
	rc  io.ReadCloser
	mu  sync.Mutex
	err error
}

func (w *watchedBody) Read(p []byte) (int, error) {
	n, err := w.rc.Read(p)
	if err != nil && err != io.EOF {
		w.mu.Lock()
		if w.err == nil {
			w.err = err
		}
		w.mu.Unlock()
	}
	return n, err
}

func (w *watchedBody) Close() error { return w.rc.Close() }

// failure returns the first read error of the caller's reader, nil for none
// (or for no body).
func (w *watchedBody) failure() error {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.err
}

// cancelOnClose ends an attempt's context when the caller closes the body.
type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelCauseFunc
}

func (c *cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel(nil)
	return err
}
