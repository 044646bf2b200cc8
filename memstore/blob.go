package memstore

import (
	"encoding/binary"
	"encoding/hex"
	"net/http"
	"strings"
	"time"
	"unsafe"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/unixnano"
)

// A record is kept as one pointer-free byte slice, a blob, so that the garbage
// collector never scans its contents: a store of a million records costs the
// collector one pointer per record (the map slot), not the dozen objects of an
// idem.Record with its strings, header map and body.
//
// Layout: a fixed part, then length-prefixed (uvarint) variable fields.
//
//	[0]      state
//	[1:9]    created at, Unix nanoseconds
//	[9:17]   lease until
//	[17:25]  expires at
//	[25:27]  status
//	[27]     flags (body omitted, has response)
//	then     scope, key, fingerprint, token, ref, header count, per header
//	         name, value count and values, body
//
// To keep records small, a fingerprint of the usual form ("v2:" and 64
// lowercase hex digits) is kept as 0x00, its version and the 32 bytes it
// spells (packFP); a complete record keeps no token (no call is fenced by it
// any more); and the names of DefaultStoredHeaders are kept as a zero length
// and a one-byte code.
//
// A blob never changes once it is visible to readers, except for the times of
// the fixed part, which readers copy out under the shard's lock: decoded records
// alias the blob's variable part (strings and body) without copying it.
const (
	offState   = 0
	offCreated = 1
	offLease   = 9
	offExpires = 17
	offStatus  = 25
	offFlags   = 27
	fixedLen   = 28

	flagOmitted  = 1
	flagResponse = 2
)

func putTime(b []byte, off int, t time.Time) {
	binary.LittleEndian.PutUint64(b[off:], uint64(unixNanos(t)))
}

// unixNanos is t in Unix nanoseconds, saturated at the ends of int64.
func unixNanos(t time.Time) int64 { return unixnano.Of(t) }

func getNanos(b []byte, off int) int64 { return int64(binary.LittleEndian.Uint64(b[off:])) }

func getTime(b []byte, off int) time.Time { return time.Unix(0, getNanos(b, off)) }

// blobSize returns the encoded size of a record with these fields, hdr being
// the encoded header (appendHeader).
func blobSize(scope, key string, fp []byte, token string, resp *idem.Response, hdr []byte) int {
	n := fixedLen + strLen(scope) + strLen(key) + uvarintLen(uint64(len(fp))) + len(fp) + strLen(token)
	if resp != nil {
		n += strLen(resp.Ref) + len(hdr) + uvarintLen(uint64(len(resp.Body))) + len(resp.Body)
	}
	return n
}

// appendHeader appends the encoded header h to dst: the count of names, then
// per name the name, the count of values and the values.
func appendHeader(dst []byte, h http.Header) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(h)))
	for name, vals := range h {
		dst = appendName(dst, name)
		dst = binary.AppendUvarint(dst, uint64(len(vals)))
		for _, v := range vals {
			dst = appendStr(dst, v)
		}
	}
	return dst
}

func strLen(s string) int { return uvarintLen(uint64(len(s))) + len(s) }

func uvarintLen(x uint64) int {
	n := 1
	for x >= 0x80 {
		x >>= 7
		n++
	}
	return n
}

// encode returns the blob of a record; fp is the fingerprint's stored form
// (packFP).
func encode(state idem.State, scope, key string, fp []byte, token string, created, lease, expires time.Time, resp *idem.Response) []byte {
	// The header is encoded first, on the stack for the usual answer, so that
	// its map is walked once and the blob is allocated at its exact size.
	var scratch [256]byte
	var hdr []byte
	if resp != nil {
		hdr = appendHeader(scratch[:0], resp.Header)
	}
	b := make([]byte, fixedLen, blobSize(scope, key, fp, token, resp, hdr))
	b[offState] = byte(state)
	putTime(b, offCreated, created)
	putTime(b, offLease, lease)
	putTime(b, offExpires, expires)
	b = appendStr(b, scope)
	b = appendStr(b, key)
	b = binary.AppendUvarint(b, uint64(len(fp)))
	b = append(b, fp...)
	b = appendStr(b, token)
	if resp != nil {
		binary.LittleEndian.PutUint16(b[offStatus:], uint16(resp.Status))
		b[offFlags] = flagResponse
		if resp.BodyOmitted {
			b[offFlags] |= flagOmitted
		}
		b = appendStr(b, resp.Ref)
		b = append(b, hdr...)
		b = binary.AppendUvarint(b, uint64(len(resp.Body)))
		b = append(b, resp.Body...)
	}
	return b
}

func appendStr(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
}

// headerNames are the header names kept as a code: DefaultStoredHeaders, and
// at 0 the empty name. The codes are part of the blob format: append only.
var headerNames = [...]string{"", "Content-Type", "Content-Language", "Content-Encoding", "Content-Location",
	"Location", "ETag", "Last-Modified", "Link"}

func headerCode(name string) (byte, bool) {
	for i, n := range headerNames {
		if n == name {
			return byte(i), true
		}
	}
	return 0, false
}

func appendName(b []byte, name string) []byte {
	if c, ok := headerCode(name); ok {
		return append(b, 0, c)
	}
	return appendStr(b, name)
}

// fpDigits is how many bytes a packed fingerprint's hex digits spell.
const fpDigits = 32

// packFP appends the stored form of the fingerprint fp to dst: "vN:" and 64
// lowercase hex digits as 0x00, "vN" and the 32 bytes they spell; any other
// fingerprint as it is, behind 0x01 if it starts with 0x00 or 0x01 itself (a
// custom FingerprintFunc may return any bytes).
func packFP(dst []byte, fp string) []byte {
	colon := strings.IndexByte(fp, ':')
	if colon < 1 || len(fp)-colon-1 != 2*fpDigits || fp[0] <= 1 {
		return appendRawFP(dst, fp)
	}
	var sum [fpDigits]byte
	digits := fp[colon+1:]
	bad := byte(0)
	for i := range sum {
		hi, lo := unhex[digits[2*i]], unhex[digits[2*i+1]]
		bad |= hi | lo
		sum[i] = hi<<4 | lo&15
	}
	if bad&0x10 != 0 {
		return appendRawFP(dst, fp)
	}
	dst = append(dst, 0)
	dst = append(dst, fp[:colon]...)
	return append(dst, sum[:]...)
}

func appendRawFP(dst []byte, fp string) []byte {
	if len(fp) > 0 && fp[0] <= 1 {
		dst = append(dst, 1)
	}
	return append(dst, fp...)
}

// unhex maps a lowercase hex digit to its value and every other byte to 0x10.
var unhex = func() (t [256]byte) {
	for c := range t {
		switch {
		case '0' <= c && c <= '9':
			t[c] = byte(c - '0')
		case 'a' <= c && c <= 'f':
			t[c] = byte(c - 'a' + 10)
		default:
			t[c] = 0x10
		}
	}
	return t
}()

// fpMatches reports whether the stored form stored is that of fp.
func fpMatches(stored []byte, fp string) bool {
	switch {
	case len(stored) == 0 || stored[0] > 1:
		return string(stored) == fp
	case stored[0] == 1:
		return string(stored[1:]) == fp
	}
	version := stored[1 : len(stored)-fpDigits]
	if len(fp) != len(version)+1+2*fpDigits || fp[:len(version)] != string(version) || fp[len(version)] != ':' {
		return false
	}
	var digits [2 * fpDigits]byte
	hex.Encode(digits[:], stored[len(stored)-fpDigits:])
	return string(digits[:]) == fp[len(version)+1:]
}

// unpackFP returns the fingerprint whose stored form is stored.
func unpackFP(stored []byte) string {
	switch {
	case len(stored) == 0 || stored[0] > 1:
		return aliasString(stored)
	case stored[0] == 1:
		return aliasString(stored[1:])
	}
	version := stored[1 : len(stored)-fpDigits]
	out := make([]byte, 0, len(version)+1+2*fpDigits)
	out = append(out, version...)
	out = append(out, ':')
	out = hex.AppendEncode(out, stored[len(stored)-fpDigits:])
	return string(out)
}

// reader walks the variable part of a blob.
type reader struct {
	b   []byte
	off int
}

func (r *reader) uvarint() int {
	x, n := binary.Uvarint(r.b[r.off:])
	r.off += n
	return int(x)
}

// bytes returns the next length-prefixed field, aliasing the blob.
func (r *reader) bytes() []byte {
	n := r.uvarint()
	v := r.b[r.off : r.off+n : r.off+n]
	r.off += n
	return v
}

// str returns the next field as a string that aliases the blob (which is never
// changed in that part).
func (r *reader) str() string { return aliasString(r.bytes()) }

// name returns the next header name.
func (r *reader) name() string {
	if r.b[r.off] == 0 {
		r.off += 2
		return headerNames[r.b[r.off-1]]
	}
	return r.str()
}

func aliasString(v []byte) string {
	if len(v) == 0 {
		return ""
	}
	return unsafe.String(&v[0], len(v))
}

// id returns the scope and key of a blob.
func id(b []byte) (scope, key string) {
	r := reader{b: b, off: fixedLen}
	return r.str(), r.str()
}

// storedFP returns the stored form of a blob's fingerprint (packFP), aliasing
// the blob.
func storedFP(b []byte) []byte {
	r := reader{b: b, off: fixedLen}
	r.bytes()
	r.bytes()
	return r.bytes()
}

// fpAndToken returns the stored fingerprint (as storedFP) and the lock token
// of a blob, in one pass.
func fpAndToken(b []byte) ([]byte, string) {
	r := reader{b: b, off: fixedLen}
	r.bytes()
	r.bytes()
	fp := r.bytes()
	return fp, r.str()
}

// tokenOf returns the lock token of a blob.
func tokenOf(b []byte) string {
	r := reader{b: b, off: fixedLen}
	r.bytes()
	r.bytes()
	r.bytes()
	return r.str()
}

func state(b []byte) idem.State { return idem.State(b[offState]) }

// decoded is a record, its response and the header values of the usual
// answer in one allocation.
type decoded struct {
	rec  idem.Record
	resp idem.Response
	vals [4]string
}

// decode returns the record a blob holds. Its strings and body alias the blob,
// or, when the blob's fingerprint is fp, fp.
func decode(b []byte, fp string) *idem.Record {
	d := &decoded{}
	r := reader{b: b, off: fixedLen}
	scope, key, stored := r.str(), r.str(), r.bytes()
	if !fpMatches(stored, fp) {
		fp = unpackFP(stored)
	}
	d.rec = idem.Record{
		Scope: scope, Key: key, Fingerprint: fp, Token: r.str(),
		State:     state(b),
		CreatedAt: getTime(b, offCreated), LeaseUntil: getTime(b, offLease), ExpiresAt: getTime(b, offExpires),
	}
	if b[offFlags]&flagResponse == 0 {
		return &d.rec
	}
	d.resp = idem.Response{
		Status:      int(binary.LittleEndian.Uint16(b[offStatus:])),
		BodyOmitted: b[offFlags]&flagOmitted != 0,
		Ref:         r.str(),
	}
	if n := r.uvarint(); n > 0 {
		// One slice for the values of every header: count them first.
		count, total := r, 0
		for range n {
			count.name()
			k := count.uvarint()
			for range k {
				count.bytes()
			}
			total += k
		}
		vals := d.vals[:]
		if total > len(vals) {
			vals = make([]string, total)
		}
		d.resp.Header = make(http.Header, n)
		used := 0
		for range n {
			name := r.name()
			k := r.uvarint()
			for i := range k {
				vals[used+i] = r.str()
			}
			d.resp.Header[name] = vals[used : used+k : used+k]
			used += k
		}
	}
	body := r.bytes()
	if !d.resp.BodyOmitted {
		d.resp.Body = body
	}
	d.rec.Response = &d.resp
	return &d.rec
}
