// Command gorillamux serves POST /orders with gorilla/mux, idem in front of
// the handler and the tenant from an authentication middleware.
//
//	go run ./examples/routers/gorillamux
package main

import (
	"log"
	"net/http"
	"time"

	"github.com/gorilla/mux"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
)

// newRouter wires the routes. mux.MiddlewareFunc is func(http.Handler)
// http.Handler, so idem's middleware goes straight into Use, after the
// authentication that sets the scope. idem keys POST and PATCH only: the GET
// route passes through it untouched.
func newRouter(store idem.Store, orders *shop.Orders) (http.Handler, error) {
	protect, err := idem.New(store, nil)
	if err != nil {
		return nil, err
	}
	r := mux.NewRouter()
	r.Use(shop.Auth, protect) // authentication (idem.WithScope), then idem
	r.Handle("/orders", shop.CreateHandler(orders)).Methods(http.MethodPost)
	r.Handle("/orders", shop.ListHandler(orders)).Methods(http.MethodGet)
	return r, nil
}

func main() {
	h, err := newRouter(memstore.New(nil), &shop.Orders{Delay: 100 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	log.Println("gorilla/mux example: listening on http://127.0.0.1:8080")
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", h))
}
