package mysqlstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/expirytest"
)

// TestExpiryBoundary runs expirytest.Boundary on MySQL/MariaDB in both flows:
// a complete record reaching ExpiresAt while duplicates on servers 1 ms apart
// and janitors race for it.
func TestExpiryBoundary(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 12, "")
			expirytest.Boundary(t, func(t *testing.T) idem.Store { return newStore(t, db) }, flow)
		})
	}
}
