// Command quickstart is the README's quick start: an orders endpoint that runs
// once per Idempotency-Key, on the in-memory store. Run it with
// `go run ./examples/quickstart` and send the README's curl command twice
// (-addr listens elsewhere than 127.0.0.1:8080).
package main

import (
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"sync/atomic"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	flag.Parse()
	handler := newServer()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("listening on http://%s", ln.Addr())
	log.Fatal(http.Serve(ln, handler))
}

var orderIDs atomic.Int64

// ordersHandler creates an order; idem makes it run once per key.
var ordersHandler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fmt.Fprintf(w, `{"id":%d}`, orderIDs.Add(1))
})

func newServer() http.Handler {
	store := memstore.New(nil)           // or sqlitestore / pgstore / mysqlstore / redisstore
	protect, err := idem.New(store, nil) // nil: defaults (POST and PATCH keyed, key required)
	if err != nil {
		log.Fatal(err)
	}
	http.Handle("POST /orders", protect(ordersHandler))
	return http.DefaultServeMux
}
