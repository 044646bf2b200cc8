package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

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
	t.Cleanup(func() { _ = rdb.Close() })           // after deletePrefix: cleanups run last-registered first
	prefix := "example_redis_" + randomHex(t) + ":" // this test's own keys
	t.Cleanup(func() { deletePrefix(t, rdb, prefix) })
	h, err := newServer(ctx, rdb, prefix)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()

	created := burst(t, srv.URL+"/orders", "redis-key-1", 20)
	status, replayed, body := post(t, srv.URL+"/orders", "redis-key-1")
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

// burst sends n identical requests with one key at the same moment and returns
// the body of the 201 they share; every other answer must be 409 in flight.
func burst(t *testing.T, url, key string, n int) string {
	t.Helper()
	type answer struct {
		status int
		body   string
	}
	answers := make([]answer, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i].status, _, answers[i].body = post(t, url, key)
		}()
	}
	close(start)
	wg.Wait()
	created := ""
	for _, a := range answers {
		switch {
		case a.status == http.StatusCreated && (created == "" || created == a.body):
			created = a.body
		case a.status == http.StatusConflict:
		default:
			t.Fatalf("answer %d %q in a burst with one key; want one 201 body (replayed or not) and 409s; all: %v", a.status, a.body, answers)
		}
	}
	if created == "" {
		t.Fatalf("no 201 among %d requests with one key: %v", n, answers)
	}
	return created
}

func post(t *testing.T, url, key string) (status int, replayed, body string) {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"cart_id":"c_42"}`))
	if err != nil {
		t.Error(err)
		return 0, "", ""
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return 0, "", ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(b)
}

func randomHex(t *testing.T) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
