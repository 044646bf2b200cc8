package pgstore

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/idemkit/idem"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// querier is what *pgxpool.Pool and pgx.Tx have in common.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// scanRecord receives the columns listed in cols.
type scanRecord struct {
	*idem.Record
	state   int16
	fp      []byte
	status  *int32
	headers []byte
	body    []byte
	omitted bool
	ref     []byte
}

func (r *scanRecord) scanTargets() []any { return r.appendTargets(make([]any, 0, 11)) }

// appendTargets appends the scan targets of cols to dst.
func (r *scanRecord) appendTargets(dst []any) []any {
	return append(dst, &r.state, &r.fp, &r.Token, &r.CreatedAt, &r.LeaseUntil, &r.ExpiresAt,
		&r.status, &r.headers, &r.body, &r.omitted, &r.ref)
}

func (r *scanRecord) finish() error {
	r.State = idem.State(r.state)
	r.Fingerprint = string(r.fp)
	switch r.State {
	case idem.StateInFlight:
		return nil
	case idem.StateComplete:
	default:
		return fmt.Errorf("pgstore: record %s has unknown state %d; was the table written by a newer pgstore?", quoteShort(r.Key), r.state)
	}
	if r.status == nil {
		return fmt.Errorf("pgstore: complete record %s has no status; the row was modified outside pgstore", quoteShort(r.Key))
	}
	h, err := decodeHeaders(r.headers)
	if err != nil {
		return fmt.Errorf("pgstore: record %s: %w", quoteShort(r.Key), err)
	}
	r.Response = &idem.Response{Status: int(*r.status), Header: h, Body: r.body, BodyOmitted: r.omitted, Ref: string(r.ref)}
	return nil
}

// nullableBytes returns b for a bytea parameter: NULL when !keep, and an empty
// (not NULL) value for an empty body that was kept.
func nullableBytes(b []byte, keep bool) []byte {
	if !keep {
		return nil
	}
	if b == nil {
		return []byte{}
	}
	return b
}

func refBytes(ref string) []byte {
	if ref == "" {
		return nil
	}
	return []byte(ref)
}

// headersParam is the parameter of the headers column (jsonb) for encoded
// headers hdr: the bytes when pgx knows the column's type from the server
// (fast), and a string otherwise, which pgx sends as text for PostgreSQL to
// parse (a []byte would go as bytea, which is not JSON). nil is NULL.
func headersParam(hdr []byte, fast bool) any {
	switch {
	case hdr == nil:
		return nil
	case fast:
		return hdr
	}
	return string(hdr)
}

// b64Value is how a header value that JSON cannot hold exactly (invalid UTF-8,
// NUL) is stored.
type b64Value struct {
	B64 string `json:"b64"`
}

// encodeHeaders encodes h as a JSON object of arrays; values are JSON strings, or
// {"b64": …} objects when they are not valid UTF-8 or contain NUL (which JSONB
// rejects), so every header round-trips byte for byte. nil for an empty header.
// It writes the JSON itself, into one buffer sized up front: it runs once per
// stored response.
func encodeHeaders(h http.Header) ([]byte, error) {
	if len(h) == 0 {
		return nil, nil
	}
	n := 2
	for name, vs := range h {
		if !utf8.ValidString(name) || strings.IndexByte(name, 0) >= 0 {
			return nil, fmt.Errorf("pgstore: header name %s is not valid UTF-8; store only well-formed header names", quoteShort(name))
		}
		n += len(name) + 6
		for _, v := range vs {
			n += len(v) + 3
		}
	}
	buf := make([]byte, 0, n+n/8)
	buf = append(buf, '{')
	for name, vs := range h {
		if len(buf) > 1 {
			buf = append(buf, ',')
		}
		buf = appendJSONString(buf, name)
		buf = append(buf, ':', '[')
		for i, v := range vs {
			if i > 0 {
				buf = append(buf, ',')
			}
			if utf8.ValidString(v) && strings.IndexByte(v, 0) < 0 {
				buf = appendJSONString(buf, v)
				continue
			}
			buf = append(buf, `{"b64":"`...)
			buf = base64.StdEncoding.AppendEncode(buf, []byte(v))
			buf = append(buf, '"', '}')
		}
		buf = append(buf, ']')
	}
	return append(buf, '}'), nil
}

// appendJSONString appends s, valid UTF-8, as a JSON string: quotes,
// backslashes and control characters escaped, everything else as is.
func appendJSONString(buf []byte, s string) []byte {
	const hex = "0123456789abcdef"
	buf = append(buf, '"')
	start := 0
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c != '"' && c != '\\' {
			continue
		}
		buf = append(buf, s[start:i]...)
		switch c {
		case '"', '\\':
			buf = append(buf, '\\', c)
		case '\n':
			buf = append(buf, '\\', 'n')
		case '\r':
			buf = append(buf, '\\', 'r')
		case '\t':
			buf = append(buf, '\\', 't')
		default:
			buf = append(buf, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
		}
		start = i + 1
	}
	buf = append(buf, s[start:]...)
	return append(buf, '"')
}

func decodeHeaders(b []byte) (http.Header, error) {
	if len(b) == 0 {
		return nil, nil
	}
	if h, ok := decodeHeadersFast(b); ok {
		return h, nil
	}
	return decodeHeadersJSON(b)
}

// decodeHeadersFast decodes what decodeHeaders decodes when no string has an
// escape and no value is a {"b64": …} object: the headers of almost every
// response. It makes three allocations (one string holding every name and
// value, one slice of values, the map) where encoding/json makes several per
// header. ok is false for anything else, valid or not.
func decodeHeadersFast(b []byte) (h http.Header, ok bool) {
	s := string(b)
	type span struct {
		lo, hi int
		name   bool
	}
	var stack [24]span
	spans := stack[:0]
	names := 0
	i := skipSpace(s, 0)
	if i == len(s) || s[i] != '{' {
		return nil, false
	}
	i = skipSpace(s, i+1)
	if i < len(s) && s[i] == '}' {
		return http.Header{}, skipSpace(s, i+1) == len(s)
	}
	for {
		lo, hi, j, ok := plainString(s, i)
		if !ok {
			return nil, false
		}
		spans = append(spans, span{lo, hi, true})
		names++
		if i = skipSpace(s, j); i == len(s) || s[i] != ':' {
			return nil, false
		}
		if i = skipSpace(s, i+1); i == len(s) || s[i] != '[' {
			return nil, false
		}
		if i = skipSpace(s, i+1); i < len(s) && s[i] != ']' {
			for {
				lo, hi, j, ok := plainString(s, i)
				if !ok {
					return nil, false
				}
				spans = append(spans, span{lo, hi, false})
				if i = skipSpace(s, j); i == len(s) || s[i] != ',' {
					break
				}
				i = skipSpace(s, i+1)
			}
		}
		if i == len(s) || s[i] != ']' {
			return nil, false
		}
		if i = skipSpace(s, i+1); i == len(s) {
			return nil, false
		}
		if s[i] == ',' {
			i = skipSpace(s, i+1)
			continue
		}
		if s[i] != '}' || skipSpace(s, i+1) != len(s) {
			return nil, false
		}
		break
	}
	vals := make([]string, len(spans)-names)
	h = make(http.Header, names)
	k := 0
	for n := 0; n < len(spans); {
		name := s[spans[n].lo:spans[n].hi]
		n++
		start := k
		for ; n < len(spans) && !spans[n].name; n++ {
			vals[k] = s[spans[n].lo:spans[n].hi]
			k++
		}
		h[name] = vals[start:k:k]
	}
	return h, true
}

// skipSpace returns the index of the first byte at or after i in s that is not
// JSON white space.
func skipSpace(s string, i int) int {
	for i < len(s) && (s[i] == ' ' || s[i] == '\t' || s[i] == '\n' || s[i] == '\r') {
		i++
	}
	return i
}

// plainString reads the JSON string at s[i] if it has no escape: its contents
// are s[lo:hi], and next is the index after its closing quote.
func plainString(s string, i int) (lo, hi, next int, ok bool) {
	if i >= len(s) || s[i] != '"' {
		return 0, 0, 0, false
	}
	for j := i + 1; j < len(s); j++ {
		switch c := s[j]; {
		case c == '"':
			return i + 1, j, j + 1, true
		case c == '\\' || c < 0x20:
			return 0, 0, 0, false
		}
	}
	return 0, 0, 0, false
}

// decodeHeadersJSON decodes any headers encodeHeaders wrote, with encoding/json.
func decodeHeadersJSON(b []byte) (http.Header, error) {
	var m map[string][]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("headers column is not the JSON pgstore writes: %w", err)
	}
	h := make(http.Header, len(m))
	for name, raws := range m {
		vs := make([]string, len(raws))
		for i, raw := range raws {
			if len(raw) > 0 && raw[0] == '"' {
				if err := json.Unmarshal(raw, &vs[i]); err != nil {
					return nil, fmt.Errorf("header %q: %w", name, err)
				}
				continue
			}
			var v b64Value
			if err := json.Unmarshal(raw, &v); err != nil {
				return nil, fmt.Errorf("header %q: %w", name, err)
			}
			dec, err := base64.StdEncoding.DecodeString(v.B64)
			if err != nil {
				return nil, fmt.Errorf("header %q: %w", name, err)
			}
			vs[i] = string(dec)
		}
		h[name] = vs
	}
	return h, nil
}

// isUndefinedTable reports whether err is PostgreSQL's undefined_table (42P01).
func isUndefinedTable(err error) bool {
	if err == nil {
		return false
	}
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "42P01"
}
