package pgstore

import (
	"crypto/sha256"
	"encoding/binary"
	"strings"
	"testing"
)

// TestLockKeyUnchanged: lockKey hashes on the stack now, and must still give
// the key earlier versions took, so that processes of both versions running at
// once exclude each other.
func TestLockKeyUnchanged(t *testing.T) {
	old := func(ns []byte, scope, key string) int64 {
		h := sha256.New()
		var n [8]byte
		for _, part := range [][]byte{ns, []byte(scope), []byte(key)} {
			binary.BigEndian.PutUint64(n[:], uint64(len(part)))
			h.Write(n[:])
			h.Write(part)
		}
		return int64(binary.BigEndian.Uint64(h.Sum(nil)))
	}
	s := &Store{lockNS: []byte("billing.idem_records")}
	for _, c := range [][2]string{{"", ""}, {"", "k"}, {"tenant", "order-1"}, {strings.Repeat("s", 128), strings.Repeat("k", 255)}, {strings.Repeat("s", 1024), strings.Repeat("k", 1024)}} {
		if got, want := s.lockKey(c[0], c[1]), old(s.lockNS, c[0], c[1]); got != want {
			t.Errorf("lockKey(%d-byte scope, %d-byte key) = %d, want %d", len(c[0]), len(c[1]), got, want)
		}
	}
}
