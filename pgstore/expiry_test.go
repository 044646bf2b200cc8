package pgstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/expirytest"
)

// TestExpiryBoundary runs expirytest.Boundary on PostgreSQL in both flows: a
// complete record reaching ExpiresAt while duplicates on servers 1 ms apart and
// janitors race for it.
func TestExpiryBoundary(t *testing.T) {
	t.Parallel()
	for _, f := range flows {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			db := newTestDB(t, 12)
			expirytest.Boundary(t, func(t *testing.T) idem.Store { return db.newStore(t) }, f.flow)
		})
	}
}
