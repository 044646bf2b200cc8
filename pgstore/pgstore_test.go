package pgstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/storetest"
)

var (
	_ idem.Store         = (*pgstore.Store)(nil)
	_ idem.TxStore       = (*pgstore.Store)(nil)
	_ idem.SingleTxStore = (*pgstore.Store)(nil)
)

func TestConformance(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 12)
	storetest.Run(t, func(t *testing.T) idem.Store { return db.newStore(t) })
}

// TestConformanceSynchronousClaim runs the suite with the claim committed
// synchronously, as a single statement.
func TestConformanceSynchronousClaim(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 12)
	storetest.Run(t, func(t *testing.T) idem.Store {
		return db.newStoreWith(t, pgstore.Config{SynchronousClaim: true})
	})
}
