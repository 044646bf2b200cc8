package redisstore_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/redisstore"
	"github.com/idemkit/idem/storetest"
)

// clusterPorts returns n ports p such that p and its cluster bus port p+10000
// are both free.
func clusterPorts(t *testing.T, n int) []int {
	t.Helper()
	var ports []int
	for tries := 0; len(ports) < n && tries < 200; tries++ {
		p := 20000 + rand.IntN(20000)
		ok := true
		for _, q := range []int{p, p + 10000} {
			l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(q))
			if err != nil {
				ok = false
				break
			}
			_ = l.Close()
		}
		for _, have := range ports {
			ok = ok && have != p
		}
		if ok {
			ports = append(ports, p)
		}
	}
	if len(ports) < n {
		t.Fatalf("found only %d free port pairs for a private Redis Cluster", len(ports))
	}
	return ports
}

// startCluster starts a private three-primary Redis Cluster and returns a
// client for it.
func startCluster(t *testing.T) *redis.ClusterClient {
	t.Helper()
	needRedisServer(t)
	ports := clusterPorts(t, 3)
	addrs := make([]string, len(ports))
	for i, p := range ports {
		startPrivateRedis(t, p, "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000")
		addrs[i] = "127.0.0.1:" + strconv.Itoa(p)
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "0", "--cluster-yes")
	if out, err := exec.Command("redis-cli", args...).CombinedOutput(); err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	// Wait until every node agrees the cluster is up.
	deadline := time.Now().Add(30 * time.Second)
	for _, a := range addrs {
		c := redis.NewClient(&redis.Options{Addr: a})
		for {
			info, err := c.ClusterInfo(context.Background()).Result()
			if err == nil && strings.Contains(info, "cluster_state:ok") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("private Redis Cluster node %s not ready: %v %s", a, err, info)
			}
			time.Sleep(100 * time.Millisecond)
		}
		_ = c.Close()
	}
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: addrs})
	t.Cleanup(func() { _ = client.Close() })
	return client
}

// TestCluster runs the conformance suite against a private three-node Redis
// Cluster through a ClusterClient, and checks that records spread over the
// nodes (each record's hash tag is its own).
func TestCluster(t *testing.T) {
	t.Parallel()
	client := startCluster(t)
	storetest.Run(t, func(t *testing.T) idem.Store {
		s, err := redisstore.New(client, &redisstore.Config{Prefix: "idemtest:" + randomHex(6) + ":"})
		if err != nil {
			t.Fatal(err)
		}
		return s // the cluster dies with the test; no cleanup needed
	})

	t.Run("spread", func(t *testing.T) {
		prefix := "idemtest:" + randomHex(6) + ":"
		s, err := redisstore.New(client, &redisstore.Config{Prefix: prefix})
		if err != nil {
			t.Fatal(err)
		}
		ctx := context.Background()
		now := time.Now()
		for i := range 30 {
			_, claimed, err := s.Claim(ctx, idem.ClaimRequest{
				Scope: "tenant", Key: fmt.Sprint("k", i), Fingerprint: "v1:c", Token: randomHex(8),
				Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour),
			})
			if err != nil || !claimed {
				t.Fatalf("Claim: %v %v", claimed, err)
			}
		}
		var nodes, total atomic.Int64 // ForEachMaster calls concurrently
		err = client.ForEachMaster(ctx, func(ctx context.Context, c *redis.Client) error {
			keys := keysUnder(t, c, prefix)
			if len(keys) > 0 {
				nodes.Add(1)
			}
			total.Add(int64(len(keys)))
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if total.Load() != 30 || nodes.Load() < 2 {
			t.Errorf("30 records of one tenant landed as %d keys on %d of 3 nodes; want them spread", total.Load(), nodes.Load())
		}
	})
}
