package proxy_test

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/proxy"
)

// An upstream that breaks its answer off after the status and part of the body
// is docs/proxy.md's 502 upstream_failed, the outcome unknown (the key stays in
// flight: the retry gets 409), whether the answer was chunked or had a
// Content-Length. Before the fix the status and the part had reached the
// middleware's recorder, and the proxy sent them on as they were: a chunked
// answer became a well-formed 201 with half a JSON body and a Content-Length
// that matched it; one with a Content-Length a 201 that broke off.
func TestAnswerBrokenOffIsUpstreamFailed(t *testing.T) {
	t.Parallel()
	for _, withLength := range []bool{false, true} {
		var runs atomic.Int64
		up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			if withLength {
				w.Header().Set("Content-Length", "100")
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusCreated)
			_, _ = w.Write([]byte(`{"id":`))
			_ = http.NewResponseController(w).Flush()
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				_ = c.Close()
			}
		}))
		t.Cleanup(up.Close)
		px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /pay"}}})
		wantProblem(t, send(t, "POST", px.url+"/pay", "{}", "Idempotency-Key", "k"), http.StatusBadGateway, proxy.CodeUpstreamFailed)
		wantProblem(t, send(t, "POST", px.url+"/pay", "{}", "Idempotency-Key", "k"), http.StatusConflict, idem.CodeKeyInUse)
		if n := runs.Load(); n != 1 {
			t.Errorf("Content-Length %v: the upstream ran %d times, want once", withLength, n)
		}
	}
}

// An answer longer than the route's MaxStoredBody still reaches the client
// whole, chunked or with its Content-Length, and a retry hears that it was not
// kept (500 idempotency_response_too_large); one at the limit is replayed.
func TestLongAnswersPassWhole(t *testing.T) {
	t.Parallel()
	const limit = 4096
	for _, size := range []int{limit, limit + 1, 300 << 10} {
		for _, withLength := range []bool{false, true} {
			body := bytes.Repeat([]byte("0123456789abcdef"), size/16+1)[:size]
			up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if withLength {
					w.Header().Set("Content-Length", strconv.Itoa(size))
				}
				w.WriteHeader(http.StatusCreated)
				for rest := body; len(rest) > 0; {
					n := min(len(rest), 1000)
					_, _ = w.Write(rest[:n])
					_ = http.NewResponseController(w).Flush()
					rest = rest[n:]
				}
			}))
			t.Cleanup(up.Close)
			px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /pay", MaxStoredBody: limit}}})
			key := "k" + strconv.Itoa(size) + strconv.FormatBool(withLength)
			a := send(t, "POST", px.url+"/pay", "{}", "Idempotency-Key", key)
			if a.status != http.StatusCreated || !bytes.Equal(a.body, body) {
				t.Fatalf("%d bytes (Content-Length %v): got %d with %d bytes, want 201 with the whole body", size, withLength, a.status, len(a.body))
			}
			b := send(t, "POST", px.url+"/pay", "{}", "Idempotency-Key", key)
			if size <= limit {
				if b.status != http.StatusCreated || !bytes.Equal(b.body, body) || b.header.Get(idem.ReplayedHeader) != "true" {
					t.Errorf("%d bytes: the retry got %d with %d bytes, want the replay", size, b.status, len(b.body))
				}
			} else if !strings.Contains(string(b.body), idem.CodeResponseTooLarge) || b.status != http.StatusInternalServerError {
				t.Errorf("%d bytes: the retry got %d %.200s, want 500 %s", size, b.status, b.body, idem.CodeResponseTooLarge)
			}
		}
	}
}

// An answer longer than MaxStoredBody that breaks off after the middleware
// began streaming it reaches the client broken off too (chunked: a well-formed
// end after the part would make it look whole). Before the fix the proxy
// recovered the ReverseProxy's abort and the middleware ended the chunked
// answer normally.
func TestLongAnswerBrokenOffBreaksOff(t *testing.T) {
	t.Parallel()
	const limit = 4096
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(bytes.Repeat([]byte("x"), 3*limit))
		_ = http.NewResponseController(w).Flush()
		if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
			_ = c.Close()
		}
	}))
	t.Cleanup(up.Close)
	px := startProxy(t, up.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /pay", MaxStoredBody: limit}}})
	req, err := http.NewRequest(http.MethodPost, px.url+"/pay", strings.NewReader("{}"))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Idempotency-Key", "k")
	resp, err := client.Do(req)
	if err == nil {
		body, rerr := io.ReadAll(resp.Body)
		resp.Body.Close()
		if rerr == nil {
			t.Fatalf("got %d with %d bytes that ended well-formed, want the answer to break off", resp.StatusCode, len(body))
		}
	}
}
