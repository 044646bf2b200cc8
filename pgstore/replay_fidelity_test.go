package pgstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/replaytest"
)

// TestReplayFidelity runs replaytest.Fidelity on PostgreSQL in both flows: a
// retry gets the first answer's status, stored headers and body bytes for
// 204/304, 1xx, empty, binary, gzip, chunked and flushed, limit-sized,
// multi-valued and odd-named answers, trailers, late headers, Set-Cookie, HEAD,
// PUT and Expect: 100-continue.
func TestReplayFidelity(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 4)
			replaytest.Fidelity(t, func(t *testing.T) idem.Store { return db.newStore(t) }, f.flow)
		})
	}
}
