package memstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/storetest"
)

var _ idem.Store = memstore.New(&memstore.Config{JanitorInterval: -1})

func TestConformance(t *testing.T) {
	storetest.Run(t, func(t *testing.T) idem.Store {
		s := memstore.New(nil)
		t.Cleanup(func() { _ = s.Close() })
		return s
	})
}
