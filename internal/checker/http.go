package checker

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/client"
	"github.com/idemkit/idem/internal/racetest"
)

// maxBody is the most of an answer the checker reads.
const maxBody = 4 << 20

// exchange is one request and its answer.
type exchange struct {
	key    string // "" when no key header was sent
	body   []byte // request body
	status int
	header http.Header
	resp   []byte
	err    error
	// wait is the time from the request's last byte to the answer's first, or
	// 0 when there was no answer.
	wait time.Duration
	// hungUp is set when the checker hung up before the answer came.
	hungUp bool
}

func (e *exchange) ok() bool { return e.err == nil && e.status >= 200 && e.status < 300 }

// replayed reports whether the answer is marked as a replay: by the client
// package's test (Idempotent-Replayed: "true" in any case, around it optional
// whitespace), so that the checker and the client never disagree on it, or by
// one of the other spellings servers use (OtherReplayMarks), which the replay
// case reports as a warning: clients look for Idempotent-Replayed.
func (e *exchange) replayed() bool {
	return e.replayMark() != ""
}

// OtherReplayMarks are the headers other than Idempotent-Replayed that servers
// in the wild set to "true" on a replay. The checker counts them as a replay
// mark, so that its findings are about the replays themselves, and warns that
// clients (idem's client.Replayed, Stripe's libraries) read Idempotent-Replayed
// only.
var OtherReplayMarks = []string{
	"Idempotency-Replayed",
	"X-Idempotent-Replayed",
	"X-Idempotency-Replayed",
	"Idempotent-Replay",
	"Idempotency-Replay",
	"X-Idempotent-Replay",
	"X-Idempotency-Replay",
	"X-Replayed",
}

// replayMark returns the name of the header that marks the answer as a replay:
// client.ReplayedHeader, one of OtherReplayMarks, or "" when it is not marked.
func (e *exchange) replayMark() string {
	if e.header == nil {
		return ""
	}
	if client.Replayed(&http.Response{Header: e.header}) {
		return client.ReplayedHeader
	}
	for _, name := range OtherReplayMarks {
		if strings.EqualFold(strings.TrimSpace(e.header.Get(name)), "true") {
			return name
		}
	}
	return ""
}

// newClient returns a client that sends each request exactly once on a fresh
// connection: with keep-alives off, Go's Transport never re-sends a request
// (it only retries on reused connections, and would do so for requests that
// carry an Idempotency-Key; docs/design.md §6). Redirects are not followed, proxies
// from the environment not used.
func newClient(timeout time.Duration) *http.Client {
	return &http.Client{
		Timeout:   timeout,
		Transport: &http.Transport{DisableKeepAlives: true, Protocols: http1()},
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return http.ErrUseLastResponse
		},
	}
}

// request builds one request to the endpoint. key "" sends no key header.
func (c *checker) request(ctx context.Context, key string, body []byte, header http.Header) (*http.Request, error) {
	r, err := http.NewRequestWithContext(ctx, c.o.Method, c.o.target.String(), bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	r.Header.Set("Content-Type", "application/json")
	r.Header.Set("User-Agent", "idem-check")
	for k, v := range header {
		r.Header[k] = v
	}
	if key != "" {
		r.Header.Set(c.o.KeyHeader, key)
	}
	return r, nil
}

// send sends one request with tenant A's headers.
func (c *checker) send(ctx context.Context, key string, body []byte) *exchange {
	return c.sendAs(ctx, key, body, c.o.Header)
}

func (c *checker) sendAs(ctx context.Context, key string, body []byte, header http.Header) *exchange {
	return c.exchange(ctx, key, body, header)
}

// errHungUp is the cause with which the checker cancels the context of a
// request it hangs up on.
var errHungUp = errors.New("checker: hung up on purpose")

// exchange sends one request and reads its answer, noting how long the answer
// took and whether the checker hung up on it (ctx cancelled with errHungUp
// before the answer came).
func (c *checker) exchange(ctx context.Context, key string, body []byte, header http.Header) *exchange {
	e := &exchange{key: key, body: body}
	var (
		mu           sync.Mutex
		wrote, first time.Time
	)
	ctx = httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteRequest: func(httptrace.WroteRequestInfo) {
			mu.Lock()
			defer mu.Unlock()
			wrote = time.Now()
		},
		GotFirstResponseByte: func() {
			mu.Lock()
			defer mu.Unlock()
			first = time.Now()
		},
	})
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		if !wrote.IsZero() && !first.IsZero() {
			e.wait = first.Sub(wrote)
		}
		e.hungUp = e.status == 0 && errors.Is(context.Cause(ctx), errHungUp)
	}()
	r, err := c.request(ctx, key, body, header)
	if err != nil {
		e.err = err
		return e
	}
	resp, err := c.client.Do(r)
	if err != nil {
		e.err = err
		return e
	}
	defer resp.Body.Close()
	e.status, e.header = resp.StatusCode, resp.Header
	e.resp, e.err = io.ReadAll(io.LimitReader(resp.Body, maxBody))
	return e
}

// fire sends n identical requests, each on its own connection dialled before a
// barrier, and releases them together (internal/racetest). Each is sent exactly
// once: its client gets the one pre-dialled connection and refuses to open
// another.
func (c *checker) fire(ctx context.Context, n int, key string, body []byte) []*exchange {
	var dialled, answered atomic.Int64
	stopProgress := c.progress(n, &dialled, &answered)
	defer stopProgress()
	results := racetest.FireContext(ctx, n, func(int) (*http.Request, error) {
		return c.request(ctx, key, body, c.o.Header)
	}, racetest.Options{
		Timeout:    c.o.Timeout,
		MaxBody:    maxBody,
		OnDialled:  func() { dialled.Add(1) },
		OnAnswered: func() { answered.Add(1) },
	})
	out := make([]*exchange, n)
	for i, r := range results {
		out[i] = &exchange{key: key, body: body, status: r.Status, header: r.Header, resp: r.Body, err: r.Err}
	}
	return out
}

// progress writes a progress line to Options.Progress every 100ms until the
// returned function is called, which finishes the line.
func (c *checker) progress(n int, dialled, answered *atomic.Int64) func() {
	w := c.o.Progress
	if w == nil {
		return func() {}
	}
	stop := make(chan struct{})
	finished := make(chan struct{})
	line := func() {
		fmt.Fprintf(w, "\rrace: %d/%d connections dialled, %d/%d answered ", dialled.Load(), n, answered.Load(), n)
	}
	go func() {
		defer close(finished)
		t := time.NewTicker(100 * time.Millisecond)
		defer t.Stop()
		for {
			line()
			select {
			case <-stop:
				line()
				fmt.Fprintln(w)
				return
			case <-t.C:
			}
		}
	}()
	return func() {
		close(stop)
		<-finished
	}
}

// http1 allows HTTP/1.1 only.
func http1() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	return p
}
