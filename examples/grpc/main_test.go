package main

import (
	"bytes"
	"context"
	"net"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/examples/internal/exampletest"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// The example's server and client in one process: a call retried with one key
// runs once and the retry is the replay; a burst of calls with one key released
// at once makes one order; another key makes another order.
func TestGRPCExample(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db, err := embedded.Open(filepath.Join(t.TempDir(), "grpc.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	srv, err := newServer(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()
	addr := ln.Addr().String()

	call := func(tenant, key, cart string) string {
		var out bytes.Buffer
		if err := callCreate(ctx, &out, addr, tenant, key, cart); err != nil {
			t.Error(err)
		}
		return out.String()
	}
	if got := call("t1", "order-42", "c_42") + call("t1", "order-42", "c_42"); got != "ord_1 replayed: false\nord_1 replayed: true\n" {
		t.Fatalf("two calls with one key printed %q", got)
	}
	// 10 calls with a new key at once: one order; the others are replays or
	// were refused while it ran (Aborted), never a second order.
	start := make(chan struct{})
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			var out bytes.Buffer
			_ = callCreate(ctx, &out, addr, "t1", "order-43", "c_43")
		}()
	}
	close(start)
	wg.Wait()
	if got := call("t2", "order-42", "c_42"); got != "ord_3 replayed: false\n" {
		t.Fatalf("another tenant's call with the key printed %q; want its own order, ord_3", got)
	}
	var n, burst int
	if err := db.QueryRowContext(ctx, `SELECT count(*), sum(cart_id = 'c_43') FROM orders`).Scan(&n, &burst); err != nil {
		t.Fatal(err)
	}
	if n != 3 || burst != 1 {
		t.Fatalf("%d orders, %d for the burst; want 3 and 1", n, burst)
	}
}

// The command as the package doc runs it: the server on -addr, the client
// twice with one key.
func TestGRPCExampleCommand(t *testing.T) {
	bin := exampletest.Build(t)
	url := exampletest.Start(t, bin, "-addr", "127.0.0.1:0", "-db", filepath.Join(t.TempDir(), "cmd.db"))
	addr := strings.TrimPrefix(url, "grpc://")
	var got []string
	for range 2 {
		out, err := exec.Command(bin, "-call", "-addr", addr, "-key", "order-42", "c_42").CombinedOutput()
		if err != nil {
			t.Fatalf("-call: %v\n%s", err, out)
		}
		got = append(got, strings.TrimSpace(string(out)))
	}
	if strings.Join(got, "\n") != "ord_1 replayed: false\nord_1 replayed: true" {
		t.Fatalf("two -call runs with one key printed %q", got)
	}
}
