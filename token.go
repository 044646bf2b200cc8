package idem

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/binary"
	"sync/atomic"
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

// newToken returns a lock token no other claim has.
func newToken() string {
	var b [16]byte
	binary.LittleEndian.PutUint64(b[:8], tokenPrefix)
	binary.BigEndian.PutUint64(b[8:], tokenCounter.Add(1))
	return base64.RawURLEncoding.EncodeToString(b[:])
}
