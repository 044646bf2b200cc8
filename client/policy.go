package client

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// maxProblemBody is the most of an answer's body read to find its problem code.
const maxProblemBody = 64 << 10

// problem is the part of an RFC 9457 problem body the client uses.
type problem struct {
	Code   string `json:"code"`
	Detail string `json:"detail"`
}

// retryableResponse reports whether resp is an answer to retry, and its problem
// body when it has one. For a 409 it peeks at the body and puts it back when the
// answer is final.
func retryableResponse(resp *http.Response) (bool, problem) {
	switch resp.StatusCode {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true, readProblem(resp, false)
	case http.StatusConflict:
		p := readProblem(resp, true)
		inFlight := p.Code == idem.CodeKeyInUse || p.Code == idem.CodeLeaseLost || resp.Header.Get("Retry-After") != ""
		return inFlight, p
	}
	return false, problem{}
}

// maybeRetryable reports whether an answer of this status may be retried,
// which retryableResponse decides, reading the body when it must.
func maybeRetryable(status int) bool {
	switch status {
	case http.StatusTooManyRequests, http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout, http.StatusConflict:
		return true
	}
	return false
}

// readProblem parses the problem in resp's body when its Content-Type is JSON.
// With keep, the bytes read are put back in front of the rest of the body.
func readProblem(resp *http.Response, keep bool) problem {
	var p problem
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if resp.Body == nil || !(mt == "application/problem+json" || mt == "application/json") {
		return p
	}
	buf, err := io.ReadAll(io.LimitReader(resp.Body, maxProblemBody))
	if keep {
		rest := resp.Body
		if err != nil {
			rest = errBody{err: err, Closer: resp.Body}
		}
		resp.Body = readCloser{Reader: io.MultiReader(bytes.NewReader(buf), rest), Closer: resp.Body}
	}
	_ = json.Unmarshal(buf, &p)
	return p
}

type readCloser struct {
	io.Reader
	io.Closer
}

// errBody replays a read error after the bytes already read.
type errBody struct {
	err error
	io.Closer
}

func (e errBody) Read([]byte) (int, error) { return 0, e.err }

// retryableErr reports whether a failed attempt is worth repeating. Connection
// errors and timeouts are (the request may have been carried out; the server's
// idempotency makes the resend safe); errors that a resend cannot fix are not.
func retryableErr(err error) bool {
	var certErr *tls.CertificateVerificationError
	var unknownAuth x509.UnknownAuthorityError
	var hostErr x509.HostnameError
	var invalidCert x509.CertificateInvalidError
	if errors.As(err, &certErr) || errors.As(err, &unknownAuth) || errors.As(err, &hostErr) || errors.As(err, &invalidCert) {
		return false
	}
	if errors.Is(err, ErrBodyUnreadable) {
		return false
	}
	msg := err.Error()
	for _, s := range []string{"unsupported protocol scheme", "invalid header field", "invalid method", "no Host in request URL"} {
		if strings.Contains(msg, s) {
			return false
		}
	}
	return true
}

// parseRetryAfter parses a Retry-After value in either form RFC 9110 allows:
// delta-seconds ("120") or an HTTP-date ("Wed, 21 Oct 2015 07:28:00 GMT"), which
// is compared with now. A date in the past gives 0. ok is false when v is empty
// or neither form.
func parseRetryAfter(v string, now time.Time) (d time.Duration, ok bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if v[0] >= '0' && v[0] <= '9' {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			var numErr *strconv.NumError
			if errors.As(err, &numErr) && errors.Is(numErr.Err, strconv.ErrRange) {
				return time.Duration(1<<63 - 1), true
			}
			return 0, false
		}
		if n > uint64((1<<63-1)/time.Second) {
			return time.Duration(1<<63 - 1), true
		}
		return time.Duration(n) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	if d := t.Sub(now); d > 0 {
		return d, true
	}
	return 0, true
}
