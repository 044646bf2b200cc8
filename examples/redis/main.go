// Command redis is the README's Redis example: idem's records live in Redis,
// shared by every instance of the service. Run it with `go run ./examples/redis`
// (it writes keys starting with "example:" in the Redis database; -redis names
// another server):
//
//	go run ./examples/redis -redis redis://127.0.0.1:6379/0 -addr 127.0.0.1:8080
//
// Redis cannot share a transaction with the business write: the claim is atomic
// and fenced, so one request per key runs at a time and a completed one is
// replayed, but if the process dies between the write and the stored answer the
// retry runs the handler again once the lease lapses. Keep the business data in
// a SQL database and use its store when both must commit together.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/redisstore"
	"github.com/redis/go-redis/v9"
)

func main() {
	redisURL := flag.String("redis", "redis://127.0.0.1:6379/0", "Redis URL")
	addr := flag.String("addr", "127.0.0.1:8080", "listen address")
	flag.Parse()
	opt, err := redis.ParseURL(*redisURL)
	if err != nil {
		log.Fatal(err)
	}
	rdb := redis.NewClient(opt) // or redis.NewUniversalClient for Sentinel and Cluster
	defer rdb.Close()
	handler, err := newServer(context.Background(), rdb, "example:")
	if err != nil {
		log.Fatal(err)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("listening on http://%s", ln.Addr())
	log.Fatal(http.Serve(ln, handler))
}

// janitorEvery is how often the janitor deletes expired key records.
var janitorEvery = time.Minute

// newServer keeps idem's records under prefix+"idem:" and the orders under
// prefix+"order:".
func newServer(ctx context.Context, rdb redis.UniversalClient, prefix string) (http.Handler, error) {
	if err := rdb.Ping(ctx).Err(); err != nil {
		return nil, fmt.Errorf("redis: %w", err)
	}
	store, err := redisstore.New(rdb, &redisstore.Config{Prefix: prefix + "idem:"}) // nil: prefix "idem:"
	if err != nil {
		return nil, err
	}
	protect, err := idem.New(store, nil) // no Migrate: Redis needs no schema and expires records itself
	if err != nil {
		return nil, err
	}
	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			CartID string `json:"cart_id"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.CartID == "" {
			http.Error(w, `send {"cart_id":"…"}`, http.StatusBadRequest) // a 4xx is stored and replayed too
			return
		}
		id, err := rdb.Incr(r.Context(), prefix+"order:seq").Result()
		if err == nil {
			err = rdb.HSet(r.Context(), fmt.Sprintf("%sorder:%d", prefix, id), "cart_id", in.CartID).Err()
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, id) // stored in Redis, then sent
	})
	mux := http.NewServeMux()
	mux.Handle("POST /orders", protect(orders))
	// The janitor deletes expired key records in bounded batches, in the
	// background, until ctx ends. Redis expires records by itself, so here it
	// finds none; it stays so that a switch to a SQL store keeps the sweep.
	janitor := &idem.Janitor{Store: store, Interval: janitorEvery, OnSweep: func(_ int, err error) {
		if err != nil {
			log.Printf("janitor: %v", err)
		}
	}}
	go func() { _ = janitor.Run(ctx) }()
	return mux, nil
}
