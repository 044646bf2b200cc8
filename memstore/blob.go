package memstore

import (
	"encoding/binary"
	"net/http"
	"time"
	"unsafe"

	"github.com/idemkit/idem"
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
	binary.LittleEndian.PutUint64(b[off:], uint64(t.UnixNano()))
}

func getNanos(b []byte, off int) int64 { return int64(binary.LittleEndian.Uint64(b[off:])) }

func getTime(b []byte, off int) time.Time { return time.Unix(0, getNanos(b, off)) }

// blobSize returns the encoded size of a record with these fields.
func blobSize(scope, key, fp, token string, resp *idem.Response) int {
	n := fixedLen + strLen(scope) + strLen(key) + strLen(fp) + strLen(token)
	if resp != nil {
		n += strLen(resp.Ref) + uvarintLen(uint64(len(resp.Header)))
		for name, vals := range resp.Header {
			n += strLen(name) + uvarintLen(uint64(len(vals)))
			for _, v := range vals {
				n += strLen(v)
			}
		}
		n += uvarintLen(uint64(len(resp.Body))) + len(resp.Body)
	}
	return n
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

// encode returns the blob of a record.
func encode(state idem.State, scope, key, fp, token string, created, lease, expires time.Time, resp *idem.Response) []byte {
	b := make([]byte, fixedLen, blobSize(scope, key, fp, token, resp))
	b[offState] = byte(state)
	putTime(b, offCreated, created)
	putTime(b, offLease, lease)
	putTime(b, offExpires, expires)
	b = appendStr(b, scope)
	b = appendStr(b, key)
	b = appendStr(b, fp)
	b = appendStr(b, token)
	if resp != nil {
		binary.LittleEndian.PutUint16(b[offStatus:], uint16(resp.Status))
		b[offFlags] = flagResponse
		if resp.BodyOmitted {
			b[offFlags] |= flagOmitted
		}
		b = appendStr(b, resp.Ref)
		b = binary.AppendUvarint(b, uint64(len(resp.Header)))
		for name, vals := range resp.Header {
			b = appendStr(b, name)
			b = binary.AppendUvarint(b, uint64(len(vals)))
			for _, v := range vals {
				b = appendStr(b, v)
			}
		}
		b = binary.AppendUvarint(b, uint64(len(resp.Body)))
		b = append(b, resp.Body...)
	}
	return b
}

func appendStr(b []byte, s string) []byte {
	b = binary.AppendUvarint(b, uint64(len(s)))
	return append(b, s...)
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
func (r *reader) str() string {
	v := r.bytes()
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

// fingerprint returns the fingerprint of a blob.
func fingerprint(b []byte) string {
	r := reader{b: b, off: fixedLen}
	r.bytes()
	r.bytes()
	return r.str()
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

// decoded is a record and its response in one allocation.
type decoded struct {
	rec  idem.Record
	resp idem.Response
}

// decode returns the record a blob holds. Its strings and body alias the blob.
func decode(b []byte) *idem.Record {
	d := &decoded{}
	r := reader{b: b, off: fixedLen}
	d.rec = idem.Record{
		Scope: r.str(), Key: r.str(), Fingerprint: r.str(), Token: r.str(),
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
			count.bytes()
			k := count.uvarint()
			for range k {
				count.bytes()
			}
			total += k
		}
		vals := make([]string, total)
		d.resp.Header = make(http.Header, n)
		used := 0
		for range n {
			name := r.str()
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
