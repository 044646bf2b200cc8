package client_test

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/client"
)

// stallServer is a raw HTTP/1.1 server on a loopback socket: connection i (from
// 0) gets answers[i] (the last one repeats) written as it is, and is then held
// open without another byte until the test ends. It counts the requests it read.
func stallServer(t *testing.T, answers ...string) (url string, requests *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	requests = new(atomic.Int64)
	done := make(chan struct{})
	t.Cleanup(func() { close(done); _ = ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				req, err := http.ReadRequest(bufio.NewReader(c))
				if err != nil {
					return
				}
				_, _ = io.Copy(io.Discard, req.Body)
				i := requests.Add(1) - 1
				_, _ = io.WriteString(c, answers[min(int(i), len(answers)-1)])
				<-done // stall: neither the rest of the body nor a close
			}()
		}
	}()
	return "http://" + ln.Addr().String() + "/orders", requests
}

const created = "HTTP/1.1 201 Created\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"

// TestStalledRetryableBodyIsAbandoned: a 503 or 409 whose headers arrive but
// whose body stalls must not hold the operation: the Transport abandons the
// attempt within AttemptTimeout (or MaxRetryBodyWait without one) and retries.
func TestStalledRetryableBodyIsAbandoned(t *testing.T) {
	t.Parallel()
	stalls := map[string]string{
		"503 problem": "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/problem+json\r\nContent-Length: 200\r\n\r\n{\"code\":",
		"503 plain":   "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 200\r\n\r\nbusy",
		"409 problem": "HTTP/1.1 409 Conflict\r\nContent-Type: application/problem+json\r\nContent-Length: 200\r\n\r\n{\"code\":\"idem",
		"429 chunked": "HTTP/1.1 429 Too Many Requests\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"co\r\n",
	}
	for name, stall := range stalls {
		for _, attemptTimeout := range []time.Duration{200 * time.Millisecond, 0} {
			t.Run(fmt.Sprintf("%s/AttemptTimeout=%v", name, attemptTimeout), func(t *testing.T) {
				t.Parallel()
				url, requests := stallServer(t, stall, created)
				tr := fast(&http.Transport{DisableKeepAlives: true}, 3)
				tr.AttemptTimeout = attemptTimeout
				// The caller's budget is far beyond the bound: only the Transport's
				// own bound can make the operation end in success.
				ctx, cancel := context.WithTimeout(context.Background(), 4*client.MaxRetryBodyWait)
				defer cancel()
				req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"cart_id":"c1"}`))
				resp, err := tr.RoundTrip(req)
				if err != nil {
					t.Fatalf("a stalled body of a retryable answer held the operation: %v", err)
				}
				body, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != 201 || string(body) != "ok" || client.Attempts(resp) != 2 || requests.Load() != 2 {
					t.Fatalf("got %d %q after %d attempts (%d requests); want 201 ok after 2", resp.StatusCode, body, client.Attempts(resp), requests.Load())
				}
			})
		}
	}
}

// TestStalledRetryableBodyInRetryError: when every answer stalls, the
// RetryError names the status seen and the stall.
func TestStalledRetryableBodyInRetryError(t *testing.T) {
	t.Parallel()
	url, requests := stallServer(t, "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 10\r\n\r\nx")
	tr := fast(&http.Transport{DisableKeepAlives: true}, 2)
	tr.AttemptTimeout = 100 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), 4*client.MaxRetryBodyWait)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader("x"))
	_, err := tr.RoundTrip(req)
	var re *client.RetryError
	if !errors.As(err, &re) || re.Attempts != 2 || re.Status != 503 || re.Stop != nil || !errors.Is(err, client.ErrAttemptTimeout) {
		t.Fatalf("err = %v (%+v); want a RetryError after 2 attempts, status 503, Is ErrAttemptTimeout", err, re)
	}
	if !strings.Contains(err.Error(), "body") || requests.Load() != 2 {
		t.Fatalf("error %q does not mention the stalled body, or %d requests", err, requests.Load())
	}
}

// failingBody yields some bytes, then fails.
type failingBody struct {
	sent bool
	err  error
}

func (f *failingBody) Read(p []byte) (int, error) {
	if !f.sent {
		f.sent = true
		return copy(p, `{"cart_id":`), nil
	}
	return 0, f.err
}

func (f *failingBody) Close() error { return nil }

// TestUnreadableBodyNotRetried: an error from the caller's request body is not
// retried, with or without GetBody: the request never reached the server
// whole, and a resend reads the same broken source.
func TestUnreadableBodyNotRetried(t *testing.T) {
	t.Parallel()
	var requests atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		requests.Add(1)
		if _, err := io.ReadAll(r.Body); err != nil {
			return // the client hung up mid-body
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	diskGone := errors.New("read /var/orders/o1.json: input/output error")
	var getBodies atomic.Int64
	req, _ := http.NewRequest(http.MethodPost, srv.URL, &failingBody{err: diskGone})
	req.ContentLength = 100
	req.GetBody = func() (io.ReadCloser, error) {
		getBodies.Add(1)
		return &failingBody{err: diskGone}, nil
	}
	_, err := fast(&http.Transport{DisableKeepAlives: true}, 4).RoundTrip(req)
	var re *client.RetryError
	if !errors.As(err, &re) || !errors.Is(err, diskGone) || !errors.Is(err, client.ErrBodyUnreadable) {
		t.Fatalf("err = %v; want a RetryError that Is the body's error and ErrBodyUnreadable", err)
	}
	if re.Attempts != 1 || getBodies.Load() != 0 {
		t.Fatalf("%d attempts, GetBody called %d times; an unreadable body must not be retried", re.Attempts, getBodies.Load())
	}
	if !strings.Contains(err.Error(), "not one to retry") {
		t.Errorf("error %q does not say it was not retried", err)
	}
}
