package proxy_test

import (
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

func mustStore() idem.Store { return memstore.New(nil) }
