package idem

import (
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strings"
)

// FingerprintFunc computes the fingerprint of a request from the request and its
// body (already read, at most Config.MaxRequestBody bytes). The result must start
// with an algorithm version and a colon ("v1:…"): the version is stored with the
// record, so that records written under an older algorithm are compared with that
// algorithm rather than reported as false mismatches.
type FingerprintFunc func(r *http.Request, body []byte) string

// fingerprintV1Version is the prefix of FingerprintV1's results.
const fingerprintV1Version = "v1"

// FingerprintV1 is the default fingerprint: "v1:" followed by the hex SHA-256 of
// the method, the URL path and the body, each separated so that no two requests
// share an input. The query string, headers and scope are not part of it (the scope
// is part of the record's identity already).
func FingerprintV1(r *http.Request, body []byte) string {
	h := sha256.New()
	var lenBuf [8]byte
	writeField := func(s []byte) {
		n := uint64(len(s))
		for i := range lenBuf {
			lenBuf[i] = byte(n >> (56 - 8*i))
		}
		h.Write(lenBuf[:])
		h.Write(s)
	}
	writeField([]byte(r.Method))
	writeField([]byte(r.URL.Path))
	writeField(body)
	var sum [sha256.Size]byte
	h.Sum(sum[:0])
	var out [len(fingerprintV1Version) + 1 + 2*sha256.Size]byte
	copy(out[:], fingerprintV1Version+":")
	hex.Encode(out[len(fingerprintV1Version)+1:], sum[:])
	return string(out[:])
}

// knownFingerprints maps algorithm versions to their functions, so that a record
// stored under an older version is compared with the algorithm that wrote it.
var knownFingerprints = map[string]FingerprintFunc{
	fingerprintV1Version: FingerprintV1,
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
// version no algorithm is known for counts as a match: idem cannot tell, and
// refusing would turn every old record into a false 422.
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
		return true, stored
	}
	legacy = f(r, body)
	return legacy == stored, legacy
}
