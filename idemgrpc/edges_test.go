package idemgrpc_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// recoverer is the recovery interceptor a server puts in front so that a
// handler's panic becomes Internal instead of killing the process.
func recoverer(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (resp any, err error) {
	defer func() {
		if v := recover(); v != nil {
			resp, err = nil, status.Errorf(codes.Internal, "panic: %v", v)
		}
	}()
	return handler(ctx, req)
}

// TestHandlerPanicFreesTheKey: a handler that panics leaves nothing behind:
// the caller hears the recovery interceptor's Internal, and the retry with the
// same key runs the method again (not a replay of the panic, not Aborted).
func TestHandlerPanicFreesTheKey(t *testing.T) {
	t.Parallel()
	var n atomic.Int64
	create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		if n.Add(1) == 1 {
			panic("boom")
		}
		return structpb.NewStruct(map[string]any{"ok": true})
	}
	addr := serve(t, newServer(t, memstore.New(nil), nil), &ordersService{create: create}, recoverer)
	cc := dial(t, addr)
	in := mustStruct(t, map[string]any{"cart": "c"})
	a := invoke(context.Background(), cc, createMethod, "k-panic", "t1", in)
	if status.Code(a.err) != codes.Internal || !strings.Contains(status.Convert(a.err).Message(), "boom") {
		t.Fatalf("panicking handler: %v; want the recovery interceptor's Internal", a.err)
	}
	b := invoke(context.Background(), cc, createMethod, "k-panic", "t1", in)
	c := invoke(context.Background(), cc, createMethod, "k-panic", "t1", in)
	if b.err != nil || b.replayed || c.err != nil || !c.replayed || n.Load() != 2 {
		t.Fatalf("after the panic: %v (replayed %v), %v (replayed %v), %d executions; want a fresh run, then its replay", b.err, b.replayed, c.err, c.replayed, n.Load())
	}
}

// TestClientDeadlineShorterThanHandler: the client gives up (its deadline
// passes) while the handler runs. The handler goes on with a context neither
// cancelled nor bounded by the client's deadline, its outcome is stored, and
// the retry with the key gets it without a second execution.
func TestClientDeadlineShorterThanHandler(t *testing.T) {
	t.Parallel()
	started, gate, done := make(chan struct{}), make(chan struct{}), make(chan error, 1)
	var n atomic.Int64
	create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		n.Add(1)
		close(started)
		<-gate
		err := ctx.Err()
		if dl, ok := ctx.Deadline(); err == nil && ok && time.Until(dl) < 5*time.Minute {
			err = fmt.Errorf("deadline in %v: the client's deadline came through, not HandlerTimeout (10m)", time.Until(dl))
		}
		done <- err
		return structpb.NewStruct(map[string]any{"id": "order-1"})
	}
	addr := serve(t, newServer(t, memstore.New(nil), &idemgrpc.Config{Idem: &idem.Config{HandlerTimeout: 10 * time.Minute}}), &ordersService{create: create})
	cc := dial(t, addr)
	in := mustStruct(t, map[string]any{"cart": "c"})

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	first := make(chan outcome, 1)
	go func() { first <- invoke(ctx, cc, createMethod, "k-deadline", "t1", in) }()
	<-started
	if o := <-first; status.Code(o.err) != codes.DeadlineExceeded {
		t.Fatalf("first call: %v; want DeadlineExceeded", o.err)
	}
	// Meanwhile the key is held: a retry hears Aborted, the handler is not run.
	if o := invoke(context.Background(), cc, createMethod, "k-deadline", "t1", in); status.Code(o.err) != codes.Aborted {
		t.Fatalf("retry while the handler runs: %v; want Aborted", o.err)
	}
	close(gate)
	if err := <-done; err != nil {
		t.Fatalf("the handler's context after the client left: %v; want it alive", err)
	}
	for i := 0; ; i++ {
		o := invoke(context.Background(), cc, createMethod, "k-deadline", "t1", in)
		if status.Code(o.err) == codes.Aborted && i < 100 { // completion not yet stored
			time.Sleep(20 * time.Millisecond)
			continue
		}
		if o.err != nil || !o.replayed || o.resp.GetFields()["id"].GetStringValue() != "order-1" {
			t.Fatalf("retry after the handler ended: %v (replayed %v, %v); want the stored answer", o.resp, o.replayed, o.err)
		}
		break
	}
	if n.Load() != 1 {
		t.Fatalf("%d executions, want 1", n.Load())
	}
}

// TestKeyMetadataShapes: two values of idempotency-key (two entries, as a
// retrying interceptor placed before the key interceptor would append) are
// refused, not silently resolved to one; a binary "idempotency-key-bin" entry
// is not the key.
func TestKeyMetadataShapes(t *testing.T) {
	t.Parallel()
	c := &counter{}
	addr := serve(t, newServer(t, memstore.New(nil), &idemgrpc.Config{Methods: []string{createMethod}}), &ordersService{create: c.create})
	cc := dial(t, addr)
	in := mustStruct(t, map[string]any{"cart": "c"})
	ctx := metadata.AppendToOutgoingContext(context.Background(), idemgrpc.MetadataKey, "a", idemgrpc.MetadataKey, "b")
	if err := cc.Invoke(ctx, createMethod, in, new(structpb.Struct)); status.Code(err) != codes.InvalidArgument || errorInfoReason(err) != "IDEMPOTENCY_KEY_INVALID" {
		t.Fatalf("two keys: %v; want InvalidArgument IDEMPOTENCY_KEY_INVALID", err)
	}
	ctx = metadata.AppendToOutgoingContext(context.Background(), idemgrpc.MetadataKey+"-bin", "\x00\xffkey")
	if err := cc.Invoke(ctx, createMethod, in, new(structpb.Struct)); status.Code(err) != codes.InvalidArgument || errorInfoReason(err) != "IDEMPOTENCY_KEY_MISSING" {
		t.Fatalf("only a -bin key: %v; want InvalidArgument IDEMPOTENCY_KEY_MISSING", err)
	}
	ctx = metadata.AppendToOutgoingContext(context.Background(), idemgrpc.MetadataKey, "has space")
	if err := cc.Invoke(ctx, createMethod, in, new(structpb.Struct)); status.Code(err) != codes.InvalidArgument || errorInfoReason(err) != "IDEMPOTENCY_KEY_INVALID" {
		t.Fatalf("a key with a space inside: %v; want InvalidArgument IDEMPOTENCY_KEY_INVALID", err)
	}
	if c.n.Load() != 0 {
		t.Fatalf("%d executions for refused keys, want 0", c.n.Load())
	}
}

// TestHugeMessages: a request message over MaxRequestBody is refused with
// ResourceExhausted before the handler runs; a response over MaxStoredBody
// reaches the first caller whole, and the retry hears Internal
// IDEMPOTENCY_RESPONSE_TOO_LARGE, not a truncated or empty message, without a
// second execution.
func TestHugeMessages(t *testing.T) {
	t.Parallel()
	var n atomic.Int64
	big := strings.Repeat("x", 64<<10)
	create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		n.Add(1)
		return structpb.NewStruct(map[string]any{"blob": big})
	}
	cfg := &idemgrpc.Config{Idem: &idem.Config{MaxRequestBody: 4 << 10, MaxStoredBody: 16 << 10}}
	addr := serve(t, newServer(t, memstore.New(nil), cfg), &ordersService{create: create})
	cc := dial(t, addr)
	o := invoke(context.Background(), cc, createMethod, "k-bigreq", "t1", mustStruct(t, map[string]any{"cart": strings.Repeat("y", 8<<10)}))
	if status.Code(o.err) != codes.ResourceExhausted || errorInfoReason(o.err) != "IDEMPOTENCY_BODY_TOO_LARGE" || n.Load() != 0 {
		t.Fatalf("request over MaxRequestBody: %v (reason %q), %d executions; want ResourceExhausted, none", o.err, errorInfoReason(o.err), n.Load())
	}
	in := mustStruct(t, map[string]any{"cart": "c"})
	a := invoke(context.Background(), cc, createMethod, "k-bigresp", "t1", in)
	if a.err != nil || a.resp.GetFields()["blob"].GetStringValue() != big {
		t.Fatalf("response over MaxStoredBody, first call: %v; want it whole", a.err)
	}
	b := invoke(context.Background(), cc, createMethod, "k-bigresp", "t1", in)
	if status.Code(b.err) != codes.Internal || errorInfoReason(b.err) != "IDEMPOTENCY_RESPONSE_TOO_LARGE" || n.Load() != 1 {
		t.Fatalf("retry of a response too large to keep: %v (reason %q), %d executions; want Internal IDEMPOTENCY_RESPONSE_TOO_LARGE, 1", b.err, errorInfoReason(b.err), n.Load())
	}
}

// plantLapsed puts an in-flight record for key whose lease lapsed an hour ago
// into mem, as a process that died mid-call leaves behind, with the
// fingerprint a Create of in under scope would have.
func plantLapsed(t *testing.T, mem *memstore.Store, scope, key string, in *structpb.Struct) {
	t.Helper()
	body, err := proto.MarshalOptions{Deterministic: true}.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	fp := idem.FingerprintV2(httptest.NewRequest("POST", createMethod, bytes.NewReader(body)), body)
	past := time.Now().Add(-time.Hour)
	if _, ok, err := mem.Claim(context.Background(), idem.ClaimRequest{Scope: scope, Key: key, Fingerprint: fp, Token: "dead",
		Now: past, LeaseUntil: past.Add(time.Minute), ExpiresAt: past.Add(48 * time.Hour)}); err != nil || !ok {
		t.Fatalf("plant a lapsed claim: %v %v", ok, err)
	}
}

// TestLapsedClaimOverGRPC: a call whose key is held by a dead claim is refused
// with FailedPrecondition IDEMPOTENCY_OUTCOME_UNKNOWN under LapsedRefuse (the
// handler does not run), and taken over, the handler run once, under the
// default LapsedTakeOver.
func TestLapsedClaimOverGRPC(t *testing.T) {
	t.Parallel()
	in := mustStruct(t, map[string]any{"cart": "c"})
	for _, mode := range []idem.LapsedLease{idem.LapsedRefuse, idem.LapsedTakeOver} {
		c := &counter{}
		mem := memstore.New(nil)
		t.Cleanup(func() { _ = mem.Close() })
		plantLapsed(t, mem, "t1", "k-lapsed", in)
		addr := serve(t, newServer(t, mem, &idemgrpc.Config{Idem: &idem.Config{LapsedLease: mode}}), &ordersService{create: c.create})
		o := invoke(context.Background(), dial(t, addr), createMethod, "k-lapsed", "t1", in)
		if mode == idem.LapsedRefuse {
			if status.Code(o.err) != codes.FailedPrecondition || errorInfoReason(o.err) != "IDEMPOTENCY_OUTCOME_UNKNOWN" || c.n.Load() != 0 {
				t.Fatalf("LapsedRefuse: %v (reason %q), %d executions; want FailedPrecondition IDEMPOTENCY_OUTCOME_UNKNOWN, none", o.err, errorInfoReason(o.err), c.n.Load())
			}
			continue
		}
		if o.err != nil || o.replayed || c.n.Load() != 1 {
			t.Fatalf("LapsedTakeOver: %v (replayed %v), %d executions; want the call taken over and run once", o.err, o.replayed, c.n.Load())
		}
	}
}
