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
	"github.com/idemkit/idem/internal/headerjson"
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
		buf = headerjson.AppendString(buf, name)
		buf = append(buf, ':', '[')
		for i, v := range vs {
			if i > 0 {
				buf = append(buf, ',')
			}
			if utf8.ValidString(v) && strings.IndexByte(v, 0) < 0 {
				buf = headerjson.AppendString(buf, v)
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

func decodeHeaders(b []byte) (http.Header, error) {
	if len(b) == 0 {
		return nil, nil
	}
	if h, ok := headerjson.DecodePlain(b); ok {
		return h, nil
	}
	return decodeHeadersJSON(b)
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
