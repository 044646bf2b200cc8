package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/idemkit/idem/examples/internal/exampletest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/redis/go-redis/v9"
)

// The Redis example, against the real server: 20 requests with one key
// released at once make one order, every 201 is the same answer, the others are
// 409; a later retry is the replay, and Redis holds one record for the key.
func TestRedisExample(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	opt, err := redis.ParseURL(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(opt)
	t.Cleanup(func() { _ = rdb.Close() })                       // after deletePrefix: cleanups run last-registered first
	prefix := "example_redis_" + exampletest.RandomHex(t) + ":" // this test's own keys
	t.Cleanup(func() { deletePrefix(t, rdb, prefix) })
	h, err := newServer(ctx, rdb, prefix)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()

	created := exampletest.Burst(t, srv.URL+"/orders", "redis-key-1", 20)
	status, replayed, body := exampletest.Post(t, srv.URL+"/orders", "redis-key-1")
	if status != http.StatusCreated || replayed != "true" || body != created {
		t.Fatalf("retry after the burst: %d %q (Idempotent-Replayed %q); want the replay of %q", status, body, replayed, created)
	}
	orders, err := rdb.Get(ctx, prefix+"order:seq").Int()
	if err != nil {
		t.Fatal(err)
	}
	records, err := rdb.Keys(ctx, prefix+"idem:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	if orders != 1 || len(records) != 1 {
		t.Fatalf("%d orders, key records %q after 21 requests with one key; want 1 and 1", orders, records)
	}
}

// deletePrefix removes every key the test wrote.
func deletePrefix(t *testing.T, rdb *redis.Client, prefix string) {
	ctx := context.Background()
	iter := rdb.Scan(ctx, 0, prefix+"*", 100).Iterator()
	for iter.Next(ctx) {
		if err := rdb.Del(ctx, iter.Val()).Err(); err != nil {
			t.Error(err)
		}
	}
	if err := iter.Err(); err != nil {
		t.Error(err)
	}
}
