package idemgrpc_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
)

// TestBuiltInRetryWaitsForPushback: a client whose grpc-go service config
// retries ABORTED (five attempts, 10 ms backoff) calls while the key is in
// flight. It hears Aborted with grpc-retry-pushback-ms (the lease left, at
// least a second), waits that long instead of spending its attempts in 50 ms,
// and its next attempt gets the first call's outcome, replayed. The first
// call is held until that next attempt arrives, so only the wait is measured
// (a lower bound, which load only lengthens).
func TestBuiltInRetryWaitsForPushback(t *testing.T) {
	t.Parallel()
	gate, started, firstDone := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var once sync.Once
	openGate := func() { once.Do(func() { close(gate) }) }
	var runs, attempts atomic.Int64
	create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		runs.Add(1)
		close(started) // the first call holds the key
		<-gate
		return structpb.NewStruct(map[string]any{"ok": true})
	}
	var retryAnswered, gap atomic.Int64 // unix nanoseconds; nanoseconds (the race detector does not see a socket's ordering)
	count := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		if len(md.Get("first")) > 0 { // the first call
			defer close(firstDone)
			return h(ctx, req)
		}
		switch attempts.Add(1) {
		case 1: // the retry's first attempt: in flight
			defer func() { retryAnswered.Store(time.Now().UnixNano()) }()
		case 2: // the retry's second attempt, after the pushback
			gap.Store(time.Now().UnixNano() - retryAnswered.Load())
			openGate()
			<-firstDone
		}
		return h(ctx, req)
	}
	s := newServer(t, memstore.New(nil), &idemgrpc.Config{Idem: &idem.Config{Lease: 2 * time.Second}})
	addr := serve(t, s, &ordersService{create: create}, count)
	cc := dial(t, addr, grpc.WithDefaultServiceConfig(`{"methodConfig":[{"name":[{"service":"idemtest.Orders"}],
		"retryPolicy":{"maxAttempts":5,"initialBackoff":"0.01s","maxBackoff":"0.01s","backoffMultiplier":1,"retryableStatusCodes":["ABORTED"]}}]}`))
	in := mustStruct(t, map[string]any{"cart": "c"})
	first := make(chan outcome, 1)
	go func() {
		first <- invoke(metadata.AppendToOutgoingContext(context.Background(), "first", "1"), cc, createMethod, "k-pushback", "t1", in)
	}()
	<-started
	o := invoke(context.Background(), cc, createMethod, "k-pushback", "t1", in)
	openGate() // when the retry gave up without coming back, the first call still ends
	if f := <-first; f.err != nil {
		t.Fatal(f.err)
	}
	if o.err != nil || !o.replayed || runs.Load() != 1 || attempts.Load() != 2 {
		t.Fatalf("call while in flight, retried by grpc-go: %v (replayed %v), %d runs, %d attempts of the retry; want the replay on its second attempt", o.err, o.replayed, runs.Load(), attempts.Load())
	}
	if gap := time.Duration(gap.Load()); gap < 900*time.Millisecond {
		t.Fatalf("the retry came back %v after the in-flight answer; want it to wait the pushback (the lease left, about 1-2 s)", gap)
	}
}
