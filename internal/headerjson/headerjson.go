// Package headerjson writes and reads stored response headers as JSON (an
// object of arrays of strings) by hand, for the SQL stores: encoding/json
// sorts the names and allocates several times per header, and these run once
// per stored response and once per replay. What it cannot do (escapes,
// values that are not UTF-8) is left to encoding/json by the callers.
package headerjson

import (
	"net/http"
	"slices"
	"unicode/utf8"
)

// ValidUTF8 reports whether every name and value of h is valid UTF-8, what
// AppendHeaders needs (encoding/json would replace other bytes with U+FFFD).
func ValidUTF8(h http.Header) bool {
	for name, vals := range h {
		if !utf8.ValidString(name) {
			return false
		}
		for _, v := range vals {
			if !utf8.ValidString(v) {
				return false
			}
		}
	}
	return true
}

// AppendHeaders appends h, every name and value valid UTF-8, as the JSON object
// of string arrays encoding/json writes (a nil value as null), but in the
// map's order and escaping only what JSON requires, growing dst once.
func AppendHeaders(dst []byte, h http.Header) []byte {
	n := 2
	for name, vs := range h {
		n += len(name) + 6
		for _, v := range vs {
			n += len(v) + 3
		}
	}
	dst = slices.Grow(dst, n+n/8)
	dst = append(dst, '{')
	first := true
	for name, vs := range h {
		if !first {
			dst = append(dst, ',')
		}
		first = false
		dst = AppendString(dst, name)
		if vs == nil {
			dst = append(dst, ":null"...)
			continue
		}
		dst = append(dst, ':', '[')
		for i, v := range vs {
			if i > 0 {
				dst = append(dst, ',')
			}
			dst = AppendString(dst, v)
		}
		dst = append(dst, ']')
	}
	return append(dst, '}')
}

// AppendString appends s, valid UTF-8, as a JSON string: quotes, backslashes
// and control characters escaped, everything else as is (encoding/json also
// escapes <, > and &, which decode the same).
func AppendString(buf []byte, s string) []byte {
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

// DecodePlain decodes a JSON object of arrays of strings in which no string
// has an escape and all is valid UTF-8 — the stored headers of almost every
// response — into what encoding/json would decode it to (a later duplicate
// name wins). It makes three allocations (one string holding every name and
// value, one slice of values, the map) where encoding/json makes several per
// header. ok is false for anything else, valid JSON or not: the caller then
// decodes with encoding/json.
func DecodePlain(b []byte) (h http.Header, ok bool) {
	if !utf8.Valid(b) {
		return nil, false // encoding/json would replace the bytes with U+FFFD
	}
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
