package mysqlstore

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"github.com/idemkit/idem/internal/headerjson"
)

// binaryHeaders starts the binary encoding of stored headers. JSON, the other
// encoding, starts with '{'.
const binaryHeaders = 0x01

// encodeHeaders encodes the stored response headers. Headers whose names and
// values are all valid UTF-8 are kept as a JSON object of string arrays, as
// earlier versions wrote them (readable by them during a rolling upgrade, and
// with SQL's JSON functions). JSON cannot hold other bytes (encoding/json turns
// them into U+FFFD), so headers with any such value, for example a Location
// with a Latin-1 file name, use a binary encoding instead: the byte 0x01, then
// the number of names, and for each the name and its values, every number an
// unsigned varint and every string its length and bytes.
func encodeHeaders(h http.Header) ([]byte, error) {
	if len(h) == 0 {
		return nil, nil
	}
	if headerjson.ValidUTF8(h) {
		return headerjson.AppendHeaders(nil, h), nil
	}
	b := []byte{binaryHeaders}
	b = binary.AppendUvarint(b, uint64(len(h)))
	for name, vals := range h {
		b = appendString(b, name)
		b = binary.AppendUvarint(b, uint64(len(vals)))
		for _, v := range vals {
			b = appendString(b, v)
		}
	}
	return b, nil
}

func appendString(b []byte, s string) []byte {
	return append(binary.AppendUvarint(b, uint64(len(s))), s...)
}

var errCorruptHeaders = errors.New("truncated or corrupt binary encoding")

// decodeHeaders decodes what encodeHeaders wrote, in either encoding.
func decodeHeaders(b []byte) (http.Header, error) {
	if len(b) == 0 {
		return nil, nil
	}
	if b[0] != binaryHeaders {
		if h, ok := headerjson.DecodePlain(b); ok {
			return h, nil
		}
		var h http.Header
		if err := json.Unmarshal(b, &h); err != nil {
			return nil, fmt.Errorf("not valid JSON: %w", err)
		}
		return h, nil
	}
	b = b[1:]
	n, b, ok := readUvarint(b)
	if !ok || n > uint64(len(b)) {
		return nil, errCorruptHeaders
	}
	h := make(http.Header, n)
	for range n {
		var name string
		var count uint64
		if name, b, ok = readString(b); !ok {
			return nil, errCorruptHeaders
		}
		if count, b, ok = readUvarint(b); !ok || count > uint64(len(b)) {
			return nil, errCorruptHeaders
		}
		vals := make([]string, count)
		for i := range vals {
			if vals[i], b, ok = readString(b); !ok {
				return nil, errCorruptHeaders
			}
		}
		h[name] = vals
	}
	if len(b) != 0 {
		return nil, errCorruptHeaders
	}
	return h, nil
}

func readUvarint(b []byte) (uint64, []byte, bool) {
	v, n := binary.Uvarint(b)
	if n <= 0 {
		return 0, b, false
	}
	return v, b[n:], true
}

func readString(b []byte) (string, []byte, bool) {
	n, b, ok := readUvarint(b)
	if !ok || n > uint64(len(b)) {
		return "", b, false
	}
	return string(b[:n]), b[n:], true
}
