package idem

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"sync/atomic"
	"unsafe"
)

// Lock tokens only have to be unique: a claim's token fences out every other
// claim of the key, in this process or another. A token is a random prefix drawn
// once per process and a counter, 16 bytes in base64url, so that a claim costs
// no call into the kernel's random source. Two processes share a prefix with a
// probability of 2^-64, and a process would have to make 2^64 claims to repeat
// one of its own.
var (
	tokenPrefix  = randomTokenPrefix()
	tokenCounter atomic.Uint64
)

func randomTokenPrefix() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return binary.LittleEndian.Uint64(b[:])
}

// tokenLen is the length of a lock token: 16 bytes in unpadded base64.
const tokenLen = 22

// newToken returns a lock token no other claim has.
func newToken() string {
	var out [tokenLen]byte
	return string(tokenInto(&out))
}

// newToken returns a lock token no other claim has, in the memory of
// req.own the first time (a later token, or one of a request with a custom
// fingerprint, gets memory of its own: the first may still be in use).
func (req *request) newToken() string {
	if req.tokUsed || req.own == nil {
		return newToken()
	}
	req.tokUsed = true
	b := tokenInto(&req.own.tok)
	return unsafe.String(&b[0], len(b))
}

// tokenInto writes a lock token no other claim has into out and returns it.
func tokenInto(out *[tokenLen]byte) []byte {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], tokenPrefix)
	binary.BigEndian.PutUint64(b[8:], tokenCounter.Add(1))
	base64.RawURLEncoding.Encode(out[:], b[:])
	return out[:]
}
