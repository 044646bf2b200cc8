// Command chi serves POST /orders with chi, idem in front of the handler and
// the tenant from an authentication middleware.
//
//	go run ./examples/routers/chi
package main

import (
	"log"
	"net/http"
	"time"

	"github.com/go-chi/chi/v5"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
)

// newRouter wires the routes: authentication for every route, idem for the
// write. chi middleware is func(http.Handler) http.Handler, which is what
// idem.New returns.
func newRouter(store idem.Store, orders *shop.Orders) (http.Handler, error) {
	protect, err := idem.New(store, nil)
	if err != nil {
		return nil, err
	}
	r := chi.NewRouter()
	r.Use(shop.Auth) // sets idem.WithScope(ctx, tenant)
	r.With(protect).Post("/orders", shop.CreateHandler(orders))
	r.Get("/orders", shop.ListHandler(orders))
	return r, nil
}

func main() {
	h, err := newRouter(memstore.New(nil), &shop.Orders{Delay: 100 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	log.Println("chi example: listening on http://127.0.0.1:8080")
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", h))
}
