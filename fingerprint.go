package idem

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"net/http"
	"strings"
	"unsafe"
)

// FingerprintFunc computes the fingerprint of a request from the request and its
// body (already read, at most Config.MaxRequestBody bytes). The result must start
// with an algorithm version and a colon ("v1:…"): the version is stored with the
// record, so that records written under an older algorithm are compared with that
// algorithm rather than reported as false mismatches.
type FingerprintFunc func(r *http.Request, body []byte) string

// Versions of the built-in fingerprints: the prefixes of their results.
const (
	fingerprintV1Version = "v1"
	fingerprintV2Version = "v2"
	fingerprintV3Version = "v3"
)

// FingerprintV3 is the default fingerprint: "v3:" followed by the hex SHA-256 of
// the method, the escaped URL path (as sent: /files/a%2Fb and /files/a/b differ,
// as the router tells them apart), the raw query string (as sent, without the
// "?": /pay?amount=1 and /pay?amount=1000 differ, and so do ?a=1&b=2 and
// ?b=2&a=1, and so do ?a=1 and ?a=%31; an empty query, "/pay?", is the same as
// none) and the body, each length-prefixed so that no two requests share an
// input. Headers, the host and the scope are not part of it (the scope is part
// of the record's identity already).
func FingerprintV3(r *http.Request, body []byte) string {
	return fingerprint(fingerprintV3Version, r.Method, r.URL.EscapedPath(), r.URL.RawQuery, true, body)
}

// fingerprintV3Len is the length of a FingerprintV3 result.
const fingerprintV3Len = len(fingerprintV3Version) + 1 + 2*sha256.Size

// fingerprintV3Into is FingerprintV3, written into out: the string it returns
// aliases out, which must not change afterwards.
func fingerprintV3Into(out *[fingerprintV3Len]byte, r *http.Request, body []byte) string {
	return fingerprintInto(out[:], fingerprintV3Version, r.Method, r.URL.EscapedPath(), r.URL.RawQuery, true, body)
}

// FingerprintV2 was the default fingerprint before FingerprintV3: like it, but
// without the query string, so that /pay?amount=1 and /pay?amount=1000 with one
// body count as one request. Records stored under it are still compared with
// it.
func FingerprintV2(r *http.Request, body []byte) string {
	return fingerprint(fingerprintV2Version, r.Method, r.URL.EscapedPath(), "", false, body)
}

// FingerprintV1 is the fingerprint of idem's first releases: like FingerprintV2,
// but over the decoded URL path, so that /files/a%2Fb and /files/a/b count as
// one request. Records stored under it are still compared with it.
func FingerprintV1(r *http.Request, body []byte) string {
	return fingerprint(fingerprintV1Version, r.Method, r.URL.Path, "", false, body)
}

// fingerprint hashes the length-prefixed method, path, query (when withQuery)
// and body under version.
func fingerprint(version, method, path, query string, withQuery bool, body []byte) string {
	return fingerprintInto(make([]byte, len(version)+1+2*sha256.Size), version, method, path, query, withQuery, body)
}

// fingerprintInto is fingerprint, written into out (len(version)+65 bytes):
// the string it returns aliases out.
func fingerprintInto(out []byte, version, method, path, query string, withQuery bool, body []byte) string {
	// One contiguous input for sha256.Sum256, on the stack for the usual small
	// request: no hash object and no copies on the heap.
	var stack [1024]byte
	in := stack[:0]
	in = binary.BigEndian.AppendUint64(in, uint64(len(method)))
	in = append(in, method...)
	in = binary.BigEndian.AppendUint64(in, uint64(len(path)))
	in = append(in, path...)
	if withQuery {
		in = binary.BigEndian.AppendUint64(in, uint64(len(query)))
		in = append(in, query...)
	}
	in = binary.BigEndian.AppendUint64(in, uint64(len(body)))
	var sum [sha256.Size]byte
	if len(in)+len(body) <= len(stack) {
		sum = sha256.Sum256(append(in, body...))
	} else { // a large body is hashed where it is, not copied
		h := sha256.New()
		h.Write(in)
		h.Write(body)
		h.Sum(sum[:0])
	}
	copy(out, version)
	out[len(version)] = ':'
	hex.Encode(out[len(version)+1:], sum[:])
	return unsafe.String(&out[0], len(out))
}

// knownFingerprints maps algorithm versions to their functions, so that a record
// stored under an older version is compared with the algorithm that wrote it.
var knownFingerprints = map[string]FingerprintFunc{
	fingerprintV1Version: FingerprintV1,
	fingerprintV2Version: FingerprintV2,
	fingerprintV3Version: FingerprintV3,
}

// fingerprintVersion returns the version prefix of fp ("v1" for "v1:ab…").
func fingerprintVersion(fp string) string {
	if i := strings.IndexByte(fp, ':'); i >= 0 {
		return fp[:i]
	}
	return ""
}

// sameRequest reports whether a request whose fingerprint (under the configured
// algorithm) is current matches a record fingerprinted as stored. When the two carry
// different versions, the request is fingerprinted again with the stored version's
// algorithm; legacy is that recomputed fingerprint (empty when not needed). A stored
// version no algorithm is known for here (a custom FingerprintFunc of another
// route sharing the store, or a newer idem) is a mismatch: a version is only ever
// compared with the algorithm that made it, and a 422 is a safe answer where a
// replay of another request's outcome is not.
func sameRequest(current, stored string, r *http.Request, body []byte) (match bool, legacy string) {
	if current == stored {
		return true, ""
	}
	sv := fingerprintVersion(stored)
	if sv == fingerprintVersion(current) {
		return false, ""
	}
	f, ok := knownFingerprints[sv]
	if !ok {
		return false, ""
	}
	legacy = f(r, body)
	return legacy == stored, legacy
}
