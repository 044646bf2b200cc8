// Package replaytest is a middleware-level test shared by the store packages:
// what a retry gets, over a real socket, compared with what the first request
// got, for handlers that answer in unusual but legal ways.
package replaytest

import (
	"bytes"
	"compress/gzip"
	"crypto/rand"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

// MaxStoredBody is the limit the cases run under.
const MaxStoredBody = 4096

// oddName is a legal header field name made of every token character that is
// not a letter or digit.
const oddName = "X-!#$%&'*+-.^_`|~"

func binaryBody(n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i)
	}
	return b
}

func gzipped(p []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	_, _ = zw.Write(p)
	_ = zw.Close()
	return buf.Bytes()
}

type answer struct {
	status  int
	header  http.Header
	trailer http.Header
	body    []byte
}

type tcase struct {
	name    string
	method  string
	expect  bool // send Expect: 100-continue
	handler http.HandlerFunc
	// check looks at the first answer and the retry beyond the common
	// comparison (status, stored headers, body).
	check func(t *testing.T, first, retry answer)
	// differs: the retry is not the first answer (the response was too large).
	differs bool
	// framing: Content-Length may differ (a chunked first answer with
	// trailers, replayed without them).
	framing bool
}

var big = binaryBody(3000) // past net/http's 2048-byte chunking threshold

var cases = []tcase{
	{name: "204", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"e204"`)
		w.WriteHeader(http.StatusNoContent)
	}},
	{name: "205", handler: func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusResetContent) }},
	{name: "304", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("ETag", `"e304"`)
		w.Header().Set("Last-Modified", "Mon, 02 Jan 2006 15:04:05 GMT")
		w.WriteHeader(http.StatusNotModified)
	}},
	{name: "1xx", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "after hints")
	}},
	{name: "201-empty", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Location", "/orders/1")
		w.WriteHeader(http.StatusCreated)
	}},
	{name: "content-length", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "5")
		_, _ = io.WriteString(w, "hello")
	}},
	{name: "content-length-too-small", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "3")
		_, _ = io.WriteString(w, "hello")
	}, check: checkHello},
	{name: "content-length-too-large", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "10")
		_, _ = io.WriteString(w, "hello")
	}, check: checkHello},
	{name: "content-length-big", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "3000")
		_, _ = w.Write(big)
	}},
	{name: "chunked-flushed", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		for i := range 4 {
			_, _ = w.Write(big[i*750 : (i+1)*750])
			http.NewResponseController(w).Flush()
		}
	}},
	{name: "binary-small", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		_, _ = w.Write(binaryBody(256))
	}},
	{name: "at-limit", handler: func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(binaryBody(MaxStoredBody))
	}},
	{name: "under-limit", handler: func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(binaryBody(MaxStoredBody - 1))
	}},
	{name: "over-limit", differs: true, handler: func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(binaryBody(MaxStoredBody))
		_, _ = w.Write([]byte{0xff})
	}, check: func(t *testing.T, first, retry answer) {
		checkTooLarge(t, first, retry, slices.Concat(binaryBody(MaxStoredBody), []byte{0xff}))
	}},
	{name: "streamed-far-over", differs: true, handler: func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
		for range 8 {
			_, _ = w.Write(binaryBody(MaxStoredBody))
			http.NewResponseController(w).Flush()
		}
	}, check: func(t *testing.T, first, retry answer) {
		checkTooLarge(t, first, retry, bytes.Repeat(binaryBody(MaxStoredBody), 8))
	}},
	{name: "multi-value", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Add("Link", "</a>; rel=next")
		w.Header().Add("Link", "</b>; rel=prev")
		w.Header().Add("Link", "</c>; rel=up")
		w.Header()[oddName] = []string{"one", "two, three", ""}
		w.WriteHeader(http.StatusCreated)
	}, check: func(t *testing.T, first, retry answer) {
		for _, a := range []answer{first, retry} {
			if got := a.header.Values("Link"); !slices.Equal(got, []string{"</a>; rel=next", "</b>; rel=prev", "</c>; rel=up"}) {
				t.Errorf("Link = %q; want the three values in order", got)
			}
			if got := a.header[oddName]; !slices.Equal(got, []string{"one", "two, three", ""}) {
				t.Errorf("%s = %q", oddName, got)
			}
		}
	}},
	{name: "gzip", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Set("Content-Type", "text/plain")
		_, _ = w.Write(gzipped(big))
	}, check: func(t *testing.T, first, retry answer) {
		if !bytes.Equal(retry.body, gzipped(big)) {
			t.Errorf("retry body is not the compressed bytes")
		}
	}},
	{name: "trailer-small", framing: true, handler: trailerHandler(100), check: checkTrailer},
	{name: "trailer-big", framing: true, handler: trailerHandler(3000), check: checkTrailer},
	{name: "header-after-writeheader", handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		w.Header().Set("Location", "/late")
		w.Header().Set("Content-Type", "application/late")
		w.Header().Set("X-Late", "1")
		_, _ = io.WriteString(w, "body")
	}, check: func(t *testing.T, first, retry answer) {
		for i, a := range []answer{first, retry} {
			if a.header.Get("Location") != "" || a.header.Get("X-Late") != "" || a.header.Get("Content-Type") != "text/plain" {
				t.Errorf("answer %d: headers set after WriteHeader were sent: Location %q, X-Late %q, Content-Type %q", i, a.header.Get("Location"), a.header.Get("X-Late"), a.header.Get("Content-Type"))
			}
		}
	}},
	{name: "many-headers-after-writeheader", handler: func(w http.ResponseWriter, r *http.Request) {
		for i := range 10 {
			w.Header().Set("X-H-"+strconv.Itoa(i), "v")
		}
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		w.Header().Set("Content-Type", "application/late")
		w.Header().Add("X-H-3", "late")
		w.Header().Set("Location", "/late")
	}, check: func(t *testing.T, first, retry answer) {
		if got := first.header.Values("X-H-3"); len(got) != 1 || first.header.Get("X-H-9") != "v" {
			t.Errorf("first answer: X-H-3 %q, X-H-9 %q; want the headers as at WriteHeader", got, first.header.Get("X-H-9"))
		}
		for i, a := range []answer{first, retry} {
			if a.header.Get("Location") != "" || a.header.Get("Content-Type") != "text/plain" {
				t.Errorf("answer %d: headers set after WriteHeader were sent: Location %q, Content-Type %q", i, a.header.Get("Location"), a.header.Get("Content-Type"))
			}
		}
	}},
	{name: "header-after-write", handler: func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "body")
		w.Header().Set("Location", "/late")
	}, check: func(t *testing.T, first, retry answer) {
		for i, a := range []answer{first, retry} {
			if a.header.Get("Location") != "" {
				t.Errorf("answer %d: Location set after the first Write was sent", i)
			}
		}
	}},
	{name: "set-cookie", handler: func(w http.ResponseWriter, r *http.Request) {
		http.SetCookie(w, &http.Cookie{Name: "session", Value: "secret"})
		w.WriteHeader(http.StatusCreated)
	}, check: func(t *testing.T, first, retry answer) {
		if first.header.Get("Set-Cookie") == "" {
			t.Errorf("the first answer lost its Set-Cookie")
		}
		if v := retry.header.Get("Set-Cookie"); v != "" {
			t.Errorf("the retry replayed Set-Cookie %q", v)
		}
	}},
	{name: "head", method: http.MethodHead, framing: true, handler: func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain")
		w.Header().Set("Content-Length", "3000")
		w.WriteHeader(http.StatusOK)
	}, check: func(t *testing.T, first, retry answer) {
		// The documented limit: Content-Length is not a stored header, so
		// the replay of a keyed HEAD says the length of the stored body
		// (none), not the one the handler declared.
		if got := first.header.Get("Content-Length"); got != "3000" {
			t.Errorf("HEAD first answer: Content-Length %q; want the handler's 3000", got)
		}
		if got := retry.header.Get("Content-Length"); got == "3000" {
			t.Errorf("HEAD replay: Content-Length %q; README says it is not replayed (update README)", got)
		}
	}},
	{name: "put", method: http.MethodPut, handler: func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(b)
	}},
	{name: "expect-continue", expect: true, handler: func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(b)
	}},
}

// checkHello: a handler whose Content-Length is not its body's length; the
// whole body is stored and replayed, so the first answer carries it whole too.
func checkHello(t *testing.T, first, retry answer) {
	t.Helper()
	for i, a := range []answer{first, retry} {
		if string(a.body) != "hello" || a.header.Get("Content-Length") != "5" {
			t.Errorf("answer %d: %q with Content-Length %q; want hello, 5", i, a.body, a.header.Get("Content-Length"))
		}
	}
}

// checkTooLarge: a response over MaxStoredBody is never replayed truncated.
// Without a transaction the first answer streams whole and retries hear 500
// idempotency_response_too_large; with one (a SQL store) nothing commits, the
// first answer is that 500 and the retry runs again (and hears it too).
func checkTooLarge(t *testing.T, first, retry answer, whole []byte) {
	t.Helper()
	switch {
	case first.status == http.StatusCreated:
		if !bytes.Equal(first.body, whole) {
			t.Errorf("first = 201 with %d bytes; want the whole %d", len(first.body), len(whole))
		}
	case first.status != http.StatusInternalServerError || !bytes.Contains(first.body, []byte(idem.CodeResponseTooLarge)):
		t.Errorf("first = %d %.200s; want the whole 201 or 500 %s", first.status, first.body, idem.CodeResponseTooLarge)
	}
	if retry.status != http.StatusInternalServerError || !bytes.Contains(retry.body, []byte(idem.CodeResponseTooLarge)) {
		t.Errorf("retry = %d %.200s; want 500 %s", retry.status, retry.body, idem.CodeResponseTooLarge)
	}
}

func trailerHandler(n int) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Trailer", "X-Checksum")
		w.Header().Set("Content-Type", "application/octet-stream")
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write(binaryBody(n))
		w.Header().Set("X-Checksum", "sum")
	}
}

// checkTrailer: the first answer carries the handler's trailer; a retry
// replays only stored headers, and Trailer is never stored, so it has none (the
// documented limit), and never carries the trailer as a header.
func checkTrailer(t *testing.T, first, retry answer) {
	if got := first.trailer.Get("X-Checksum"); got != "sum" {
		t.Errorf("first answer: trailer X-Checksum = %q (trailers %v, Content-Length %q); want sum", got, first.trailer, first.header.Get("Content-Length"))
	}
	if got := retry.trailer.Get("X-Checksum"); got != "" {
		t.Errorf("retry: trailer X-Checksum = %q; trailers are not stored", got)
	}
	for i, a := range []answer{first, retry} {
		if got := a.header.Get("X-Checksum"); got != "" {
			t.Errorf("answer %d: the trailer was sent as a header", i)
		}
	}
}

// Fidelity runs every case on a store made by newStore with flow: each case's
// handler answers a keyed request on a loopback server, the same request is
// sent again, and the retry must carry the first answer's status, the stored
// headers' values and the same body bytes, plus what the case checks.
func Fidelity(t *testing.T, newStore func(t *testing.T) idem.Store, flow idem.Flow) {
	t.Helper()
	store := newStore(t)
	stored := slices.Concat(idem.DefaultStoredHeaders, []string{oddName})
	mw, err := idem.New(store, &idem.Config{
		Flow:          flow,
		Methods:       []string{"POST", "PATCH", "PUT", "HEAD"},
		StoredHeaders: stored,
		MaxStoredBody: MaxStoredBody,
	})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	for _, c := range cases {
		mux.Handle("/"+c.name, c.handler)
	}
	srv := httptest.NewServer(mw(mux))
	t.Cleanup(srv.Close)
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	t.Cleanup(client.CloseIdleConnections)
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			key := "replay-" + c.name + "-" + randomHex()
			send := func() answer {
				t.Helper()
				method := c.method
				if method == "" {
					method = http.MethodPost
				}
				var body io.Reader
				if method != http.MethodHead {
					body = strings.NewReader(`{"case":"` + c.name + `"}`)
				}
				req, err := http.NewRequest(method, srv.URL+"/"+c.name, body)
				if err != nil {
					t.Fatal(err)
				}
				req.Header.Set(idem.DefaultHeaderName, key)
				if c.expect {
					req.Header.Set("Expect", "100-continue")
				}
				resp, err := client.Do(req)
				if err != nil {
					t.Fatalf("%s: %v", method, err)
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				if err != nil {
					t.Fatalf("reading the body: %v", err)
				}
				return answer{status: resp.StatusCode, header: resp.Header, trailer: resp.Trailer, body: b}
			}
			first := send()
			retry := send()
			if !c.differs {
				if first.header.Get(idem.ReplayedHeader) != "" || retry.header.Get(idem.ReplayedHeader) != "true" {
					t.Errorf("%s: first %q, retry %q; want only the retry replayed", idem.ReplayedHeader, first.header.Get(idem.ReplayedHeader), retry.header.Get(idem.ReplayedHeader))
				}
				if retry.status != first.status {
					t.Errorf("status: first %d, retry %d", first.status, retry.status)
				}
				if !bytes.Equal(first.body, retry.body) {
					t.Errorf("body: first %d bytes, retry %d bytes, not the same", len(first.body), len(retry.body))
				}
				for _, name := range stored {
					if f, r := first.header.Values(name), retry.header.Values(name); !slices.Equal(f, r) {
						t.Errorf("header %s: first %q, retry %q", name, f, r)
					}
				}
				if f, r := first.header.Get("Content-Length"), retry.header.Get("Content-Length"); f != r && !c.framing {
					t.Errorf("Content-Length: first %q, retry %q", f, r)
				}
			}
			if c.check != nil {
				c.check(t, first, retry)
			}
		})
	}
}

func randomHex() string {
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
