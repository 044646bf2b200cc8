package redisstore_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/redisstore"
)

// killClients ends, with CLIENT KILL ID, every connection of the shared Redis
// named name (this test's own, by CLIENT SETNAME) and returns how many.
func killClients(t *testing.T, admin *redis.Client, name string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	list, err := admin.ClientList(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(list, "\n") {
		var id string
		mine := false
		for _, f := range strings.Fields(line) {
			if v, ok := strings.CutPrefix(f, "id="); ok {
				id = v
			}
			if f == "name="+name {
				mine = true
			}
		}
		if mine && id != "" {
			if err := admin.Do(ctx, "CLIENT", "KILL", "ID", id).Err(); err != nil {
				t.Fatal(err)
			}
			n++
		}
	}
	return n
}

// TestClientKilledBetweenRequests: the store's pooled connections are ended
// by CLIENT KILL between rounds of concurrent requests (as a Redis restart or
// a proxy's idle timeout ends them). Every request of the next round must
// execute once, and replay after.
func TestClientKilledBetweenRequests(t *testing.T) {
	t.Parallel()
	opts, err := redis.ParseURL(testenv.RedisURL(t))
	if err != nil {
		t.Fatal(err)
	}
	admin := redis.NewClient(opts)
	t.Cleanup(func() { _ = admin.Close() })
	name := "idemtest-" + randomHex(6)
	mine := *opts
	mine.ClientName, mine.PoolSize = name, 4
	client := redis.NewClient(&mine)
	prefix := "idemtest:" + randomHex(6) + ":"
	t.Cleanup(func() {
		deletePrefix(t, admin, prefix)
		_ = client.Close()
	})
	store, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	h := newOrderHandler()
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(h))
	t.Cleanup(srv.Close)
	const n = 8
	killed := 0
	for round := range 4 {
		var wg sync.WaitGroup
		for i := range n {
			key := fmt.Sprintf("k%d-%d", round, i)
			wg.Go(func() {
				st, hdr, body, err := tryPost(srv.URL, key)
				if err != nil || st != http.StatusCreated || hdr.Get(idem.ReplayedHeader) == "true" {
					t.Errorf("%s: %d %s %v", key, st, body, err)
				}
			})
		}
		wg.Wait()
		for i := range n {
			key := fmt.Sprintf("k%d-%d", round, i)
			if r := h.runsOf(key); r != 1 {
				t.Errorf("%s ran %d times", key, r)
			}
			st, hdr, body, err := tryPost(srv.URL, key)
			if err != nil || st != http.StatusCreated || hdr.Get(idem.ReplayedHeader) != "true" {
				t.Errorf("%s again: %d %s %v", key, st, body, err)
			}
		}
		killed += killClients(t, admin, name)
	}
	if killed == 0 {
		t.Fatal("no connection of the store was killed")
	}
}
