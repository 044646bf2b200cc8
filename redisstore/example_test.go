package redisstore_test

import (
	"fmt"
	"log"
	"net/http"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/redisstore"
)

// Example wires the Redis store into the middleware. Any redis.UniversalClient
// works: pass several Addrs for a Cluster, or a MasterName for Sentinel.
func Example() {
	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"localhost:6379"}})
	defer rdb.Close()
	store, err := redisstore.New(rdb, &redisstore.Config{Prefix: "orders-api:idem:"})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := idem.New(store, nil)
	if err != nil {
		log.Fatal(err)
	}
	createOrder := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Location", "/orders/1")
		w.WriteHeader(http.StatusCreated)
	})
	http.Handle("POST /orders", mw(createOrder))
	// http.ListenAndServe(":8080", nil)
}

// ExampleNew shows that New checks its configuration without touching Redis, and
// says what to change.
func ExampleNew() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"}) // not dialled by New
	defer rdb.Close()
	_, err := redisstore.New(rdb, &redisstore.Config{Prefix: "idem:{orders}:"})
	fmt.Println(err)
	store, err := redisstore.New(rdb, nil)
	fmt.Println(store.ExpiresRecordsItself(), err)
	// Output:
	// redisstore: Config.Prefix "idem:{orders}:" contains '{' or '}', which would change the Redis Cluster hash tag of every key; choose a prefix without braces, such as "idem:"
	// true <nil>
}
