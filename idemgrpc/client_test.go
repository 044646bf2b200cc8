package idemgrpc_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/idemgrpc/internal/h2lossy"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
)

// retryPolicy is gRPC's own retry policy: the only retries in the lossy test.
const retryPolicy = `{"methodConfig":[{"name":[{"service":"idemtest.Orders"}],
 "retryPolicy":{"maxAttempts":5,"initialBackoff":"0.01s","maxBackoff":"0.1s","backoffMultiplier":2,
 "retryableStatusCodes":["UNAVAILABLE","ABORTED"]}}]}`

// ledger records, on the server, every attempt's key and every execution.
type ledger struct {
	mu       sync.Mutex
	keys     map[string]map[string]int // cart → key → attempts that reached the server
	executed map[string]int            // cart → executions
}

func newLedger() *ledger {
	return &ledger{keys: make(map[string]map[string]int), executed: make(map[string]int)}
}

// record is a server interceptor in front of everything.
func (l *ledger) record(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	cart := req.(*structpb.Struct).GetFields()["cart"].GetStringValue()
	l.mu.Lock()
	if l.keys[cart] == nil {
		l.keys[cart] = make(map[string]int)
	}
	l.keys[cart][fmt.Sprint(md.Get(idemgrpc.MetadataKey))]++
	l.mu.Unlock()
	return handler(ctx, req)
}

func (l *ledger) create(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
	cart := in.GetFields()["cart"].GetStringValue()
	l.mu.Lock()
	l.executed[cart]++
	l.mu.Unlock()
	return structpb.NewStruct(map[string]any{"cart": cart})
}

// lossyRun places n orders, one after the other, through a proxy that loses
// answers, with gRPC's retry policy; withIdem puts the server and client
// interceptors in place. It returns the ledger and how many answers were lost.
func lossyRun(t *testing.T, n int, withIdem bool) (*ledger, int64) {
	l := newLedger()
	var s *idemgrpc.Server
	if withIdem {
		s = newServer(t, memstore.New(nil), nil)
	}
	addr := serve(t, s, &ordersService{create: l.create}, l.record)
	proxy, err := h2lossy.New(addr, 0.3, 2, uint64(time.Now().UnixNano()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	opts := []grpc.DialOption{
		grpc.WithDefaultServiceConfig(retryPolicy),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)),
	}
	if withIdem {
		opts = append(opts, grpc.WithChainUnaryInterceptor(idemgrpc.UnaryClientInterceptor(nil)))
	}
	cc := dial(t, proxy.Addr(), opts...)
	for i := range n {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		cart := fmt.Sprintf("cart-%d", i)
		o := invoke(ctx, cc, createMethod, "", "t1", mustStruct(t, map[string]any{"cart": cart}))
		cancel()
		if o.err != nil {
			t.Fatalf("order %d: %v (gRPC's retry policy allows 5 attempts, the proxy loses at most 2 answers in a row)", i, o.err)
		}
	}
	return l, proxy.Dropped()
}

// TestClientThroughLossyProxy: N orders through a link that loses answers after
// the server carried the call out, retried by gRPC's own retry policy, make
// exactly N orders, and every attempt of one order carried the one key the
// client interceptor made before its first attempt. Without idem the same run
// makes more than N.
func TestClientThroughLossyProxy(t *testing.T) {
	t.Parallel()
	const n = 40
	t.Run("idem", func(t *testing.T) {
		t.Parallel()
		l, dropped := lossyRun(t, n, true)
		if dropped == 0 {
			t.Fatal("the proxy lost no answer; the run proves nothing")
		}
		retried := 0
		for i := range n {
			cart := fmt.Sprintf("cart-%d", i)
			if e := l.executed[cart]; e != 1 {
				t.Errorf("%s: %d executions, want exactly 1", cart, e)
			}
			keys := l.keys[cart]
			if len(keys) != 1 {
				t.Errorf("%s: attempts carried %d different keys %v, want one key for every attempt", cart, len(keys), keys)
			}
			for k, attempts := range keys {
				if k == "[]" {
					t.Errorf("%s: an attempt without a key", cart)
				}
				if attempts > 1 {
					retried++
				}
			}
		}
		t.Logf("%d orders, %d answers lost, %d orders retried with their key, %d executions", n, dropped, retried, len(l.executed))
		if retried == 0 {
			t.Error("no order was retried")
		}
	})
	t.Run("control without idem", func(t *testing.T) {
		t.Parallel()
		l, dropped := lossyRun(t, n, false)
		total := 0
		for _, e := range l.executed {
			total += e
		}
		t.Logf("without idem: %d orders placed, %d executions, %d answers lost", n, total, dropped)
		if total <= n {
			t.Errorf("without idem %d executions for %d orders; the lossy link should have made duplicates", total, n)
		}
	})
}

// TestClientKeyOptions: WithKey and a key already in the metadata are kept;
// unlisted methods get none.
func TestClientKeyOptions(t *testing.T) {
	t.Parallel()
	l := newLedger()
	addr := serve(t, nil, &ordersService{create: l.create, get: l.create}, l.record)
	cc := dial(t, addr, grpc.WithChainUnaryInterceptor(idemgrpc.UnaryClientInterceptor(&idemgrpc.ClientConfig{
		Methods: []string{createMethod}, NewKey: func() string { return "made" },
	})))
	ctx := context.Background()
	call := func(ctx context.Context, method, cart string) {
		if o := invoke(ctx, cc, method, "", "", mustStruct(t, map[string]any{"cart": cart})); o.err != nil {
			t.Fatal(o.err)
		}
	}
	call(ctx, createMethod, "a")
	call(idemgrpc.WithKey(ctx, "mine"), createMethod, "b")
	call(metadata.AppendToOutgoingContext(ctx, idemgrpc.MetadataKey, "given"), createMethod, "c")
	call(ctx, getMethod, "d")
	for cart, want := range map[string]string{"a": "[made]", "b": "[mine]", "c": "[given]", "d": "[]"} {
		if l.keys[cart][want] != 1 || len(l.keys[cart]) != 1 {
			t.Errorf("%s: keys %v, want %s", cart, l.keys[cart], want)
		}
	}
}
