package main

import (
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem/examples/routers/internal/routertest"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
)

// TestIdemCheck runs every case of idem check against the chi router.
func TestIdemCheck(t *testing.T) {
	h, err := newRouter(memstore.New(nil), &shop.Orders{Delay: 50 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	routertest.Check(t, srv.URL+"/orders", srv.URL+"/orders?cart_id={{marker}}")
}
