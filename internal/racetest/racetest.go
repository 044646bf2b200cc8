// Package racetest fires many HTTP requests at the same instant and collects the
// answers, for tests and tools (idem check) that must prove concurrency
// concurrently: every request is prepared and its connection dialled first, then
// all are released from one barrier. Each request uses its own connection and is sent exactly once (Go's
// Transport would silently re-send a request carrying an Idempotency-Key on a
// dropped reused connection; see docs/design.md §6).
package racetest

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// Result is one answer.
type Result struct {
	Status int
	Header http.Header
	Body   []byte
	Err    error
}

// Options tune FireContext. The zero value is fine.
type Options struct {
	// Timeout bounds each dial and each request. Defaults to 60 seconds.
	Timeout time.Duration
	// MaxBody is the most of each answer's body that is read. Defaults to no limit.
	MaxBody int64
	// OnDialled and OnAnswered, when set, are called (from the requests'
	// goroutines) as each connection is dialled and each request ends, for progress
	// reports.
	OnDialled, OnAnswered func()
}

// Fire sends n copies of the request built by newReq, released together, and
// returns the answers in no particular order. newReq is called n times before the
// barrier opens.
func Fire(n int, newReq func(i int) (*http.Request, error)) []Result {
	return FireContext(context.Background(), n, newReq, Options{})
}

// FireContext is Fire with a context for the dials and options. results[i] is
// the answer to the i-th request newReq built. Requests use HTTP/1.1, each on the
// one connection dialled for it before the barrier, and redirects are not
// followed.
func FireContext(ctx context.Context, n int, newReq func(i int) (*http.Request, error), opts Options) []Result {
	if opts.Timeout <= 0 {
		opts.Timeout = 60 * time.Second
	}
	results := make([]Result, n)
	reqs := make([]*http.Request, n)
	for i := range reqs {
		r, err := newReq(i)
		if err != nil {
			results[i].Err = err
			continue
		}
		reqs[i] = r
	}
	start := make(chan struct{})
	var ready, done sync.WaitGroup
	for i, r := range reqs {
		if r == nil {
			continue
		}
		ready.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			if opts.OnAnswered != nil {
				defer opts.OnAnswered()
			}
			// Dial before the barrier, so that the release is not spread out by
			// connection setup; the transport gets this one connection and no other.
			d := net.Dialer{Timeout: opts.Timeout}
			conn, err := d.DialContext(ctx, "tcp", hostPort(r))
			if err != nil {
				results[i].Err = err
				ready.Done()
				return
			}
			if opts.OnDialled != nil {
				opts.OnDialled()
			}
			var once sync.Once
			client := &http.Client{
				Timeout: opts.Timeout,
				Transport: &http.Transport{
					DisableKeepAlives: true, // one connection, one attempt
					Protocols:         http1(),
					DialContext: func(context.Context, string, string) (net.Conn, error) {
						var c net.Conn
						once.Do(func() { c = conn })
						if c == nil {
							return nil, errors.New("racetest: a second connection was asked for; the request would have been sent twice, so it was not")
						}
						return c, nil
					},
				},
				CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
			}
			defer client.CloseIdleConnections()
			ready.Done()
			<-start
			resp, err := client.Do(r)
			if err != nil {
				results[i].Err = err
				return
			}
			defer resp.Body.Close()
			var body io.Reader = resp.Body
			if opts.MaxBody > 0 {
				body = io.LimitReader(resp.Body, opts.MaxBody)
			}
			b, err := io.ReadAll(body)
			results[i] = Result{Status: resp.StatusCode, Header: resp.Header, Body: b, Err: err}
		}()
	}
	ready.Wait()
	close(start)
	done.Wait()
	return results
}

// http1 allows HTTP/1.1 only.
func http1() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	return p
}

// Post returns a newReq for Fire that POSTs body as JSON to url with the given
// idempotency key and extra headers.
func Post(url, key string, body []byte, header http.Header) func(int) (*http.Request, error) {
	return func(int) (*http.Request, error) {
		r, err := http.NewRequest(http.MethodPost, url, bytes.NewReader(body))
		if err != nil {
			return nil, err
		}
		r.Header.Set("Content-Type", "application/json")
		if key != "" {
			r.Header.Set("Idempotency-Key", key)
		}
		for k, v := range header {
			r.Header[k] = v
		}
		return r, nil
	}
}

// hostPort returns the address to dial for r, with the scheme's default port
// when the URL names none.
func hostPort(r *http.Request) string {
	if r.URL.Port() != "" {
		return r.URL.Host
	}
	port := "80"
	if r.URL.Scheme == "https" {
		port = "443"
	}
	return net.JoinHostPort(r.URL.Hostname(), port)
}
