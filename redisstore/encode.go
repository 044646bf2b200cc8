package redisstore

import (
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/idemkit/idem"
)

// Field names of the record hash (see the package documentation, "Schema").
const (
	fState   = "state"
	fFP      = "fp"
	fToken   = "token"
	fCreated = "created"
	fLease   = "lease"
	fExpires = "expires"
	fStatus  = "status"
	fHeaders = "headers"
	fBody    = "body"
	fOmitted = "omitted"
	fRef     = "ref"
)

// recordKey returns the Redis key of (scope, key):
//
//	<prefix>{<base64url(scope)>.<base64url(key)>}
//
// Base64url (unpadded) has no '.', '{' or '}', so the pair is recovered
// unambiguously, no two pairs share a key, and the hash tag is always exactly the
// encoded pair, whatever the tenant puts into scope or key.
func (s *Store) recordKey(scope, key string) string {
	enc := base64.RawURLEncoding
	b := make([]byte, 0, len(s.prefix)+enc.EncodedLen(len(scope))+enc.EncodedLen(len(key))+3)
	b = append(b, s.prefix...)
	b = append(b, '{')
	b = enc.AppendEncode(b, []byte(scope))
	b = append(b, '.')
	b = enc.AppendEncode(b, []byte(key))
	b = append(b, '}')
	return string(b)
}

// encodeHeader encodes h compactly and byte-exactly (values need not be UTF-8):
// uvarint(number of names), then per name in sorted order uvarint(len) name
// uvarint(number of values), then per value uvarint(len) value. An empty header
// encodes as nothing.
func encodeHeader(h http.Header) []byte {
	if len(h) == 0 {
		return nil
	}
	names := make([]string, 0, len(h))
	size := binary.MaxVarintLen64
	for name, vals := range h {
		names = append(names, name)
		size += 2*binary.MaxVarintLen64 + len(name)
		for _, v := range vals {
			size += binary.MaxVarintLen64 + len(v)
		}
	}
	slices.Sort(names)
	b := make([]byte, 0, size)
	b = binary.AppendUvarint(b, uint64(len(names)))
	for _, name := range names {
		b = appendString(b, name)
		vals := h[name]
		b = binary.AppendUvarint(b, uint64(len(vals)))
		for _, v := range vals {
			b = appendString(b, v)
		}
	}
	return b
}

func appendString(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

var errMalformed = errors.New("malformed")

// decodeHeader is the inverse of encodeHeader.
func decodeHeader(s string) (http.Header, error) {
	if s == "" {
		return nil, nil
	}
	d := decoder{s: s}
	n := d.uvarint()
	if d.err != nil || n > uint64(len(s)) {
		return nil, errMalformed
	}
	h := make(http.Header, n)
	for range n {
		name := d.str()
		nv := d.uvarint()
		if d.err != nil || nv > uint64(len(d.s)) {
			return nil, errMalformed
		}
		vals := make([]string, nv)
		for i := range vals {
			vals[i] = d.str()
		}
		if d.err != nil {
			return nil, d.err
		}
		h[name] = vals
	}
	if len(d.s) != 0 {
		return nil, errMalformed
	}
	return h, nil
}

type decoder struct {
	s   string
	err error
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint([]byte(d.s[:min(len(d.s), binary.MaxVarintLen64)]))
	if n <= 0 {
		d.err = errMalformed
		return 0
	}
	d.s = d.s[n:]
	return v
}

func (d *decoder) str() string {
	n := d.uvarint()
	if d.err != nil {
		return ""
	}
	if n > uint64(len(d.s)) {
		d.err = errMalformed
		return ""
	}
	v := d.s[:n]
	d.s = d.s[n:]
	return v
}

// decodeRecord builds a record from the fields of its hash.
func decodeRecord(scope, key string, f map[string]string) (*idem.Record, error) {
	bad := func(field string) error {
		return fmt.Errorf("redisstore: the record for key %q has a malformed %q field; it was not written by this version of redisstore (delete it, or give the store its own Config.Prefix)", key, field)
	}
	msField := func(field string) (time.Time, error) {
		n, err := strconv.ParseInt(f[field], 10, 64)
		if err != nil {
			return time.Time{}, bad(field)
		}
		return time.UnixMilli(n), nil
	}
	rec := &idem.Record{Scope: scope, Key: key, Fingerprint: f[fFP], Token: f[fToken]}
	switch f[fState] {
	case "1":
		rec.State = idem.StateInFlight
	case "2":
		rec.State = idem.StateComplete
	default:
		return nil, bad(fState)
	}
	var err error
	if rec.CreatedAt, err = msField(fCreated); err != nil {
		return nil, err
	}
	if rec.LeaseUntil, err = msField(fLease); err != nil {
		return nil, err
	}
	if rec.ExpiresAt, err = msField(fExpires); err != nil {
		return nil, err
	}
	if rec.State != idem.StateComplete {
		return rec, nil
	}
	resp := &idem.Response{Ref: f[fRef], BodyOmitted: f[fOmitted] == "1"}
	if resp.Status, err = strconv.Atoi(f[fStatus]); err != nil {
		return nil, bad(fStatus)
	}
	if resp.Header, err = decodeHeader(f[fHeaders]); err != nil {
		return nil, bad(fHeaders)
	}
	if body, ok := f[fBody]; ok && !resp.BodyOmitted {
		resp.Body = []byte(body)
	}
	rec.Response = resp
	return rec, nil
}
