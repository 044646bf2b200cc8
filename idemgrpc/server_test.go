package idemgrpc_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

func newServer(t testing.TB, store idem.Store, cfg *idemgrpc.Config) *idemgrpc.Server {
	t.Helper()
	s, err := idemgrpc.NewServer(store, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// counter is a Create handler that counts its executions and answers
// {"id": n, "cart": cart} after delay.
type counter struct {
	n     atomic.Int64
	delay time.Duration
}

func (c *counter) create(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
	n := c.n.Add(1)
	time.Sleep(c.delay)
	return structpb.NewStruct(map[string]any{"id": float64(n), "cart": in.GetFields()["cart"].GetStringValue()})
}

func errorInfoReason(err error) string {
	st, _ := status.FromError(err)
	for _, d := range st.Details() {
		if ei, ok := d.(*errdetails.ErrorInfo); ok {
			return ei.GetReason()
		}
	}
	return ""
}

// race fires n calls of Create with one key and one message at the same moment
// and returns their outcomes.
func race(t *testing.T, cc callConn, n int, key string, in *structpb.Struct) []outcome {
	t.Helper()
	out := make([]outcome, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			<-start
			out[i] = cc.call(key, in)
		})
	}
	close(start)
	wg.Wait()
	return out
}

type callConn func(key string, in *structpb.Struct) outcome

func (c callConn) call(key string, in *structpb.Struct) outcome { return c(key, in) }

// judgeRace checks that of the outcomes exactly one is the original, and every
// other one a replay of it or Aborted with a RetryInfo delay.
func judgeRace(t *testing.T, out []outcome) {
	t.Helper()
	var original *structpb.Struct
	originals, replays, aborted := 0, 0, 0
	for _, o := range out {
		if o.err == nil && !o.replayed {
			originals++
			original = o.resp
		}
	}
	if originals != 1 {
		t.Fatalf("%d calls got a fresh (not replayed) answer, want exactly 1", originals)
	}
	for i, o := range out {
		switch {
		case o.err == nil && !o.replayed:
		case o.err == nil && o.replayed:
			replays++
			if !proto.Equal(o.resp, original) {
				t.Errorf("call %d: replay %v differs from the original %v", i, o.resp, original)
			}
		case status.Code(o.err) == codes.Aborted:
			aborted++
			d, ok := idemgrpc.RetryDelay(o.err)
			if !ok || d <= 0 || errorInfoReason(o.err) != "IDEMPOTENCY_KEY_IN_USE" {
				t.Errorf("call %d: Aborted without a RetryInfo delay (%v, %v) or reason IDEMPOTENCY_KEY_IN_USE (%q)", i, d, ok, errorInfoReason(o.err))
			}
		default:
			t.Errorf("call %d: %v; want the original, a replay or Aborted", i, o.err)
		}
	}
	t.Logf("%d calls: 1 original, %d replays, %d Aborted", len(out), replays, aborted)
}

// TestConcurrentOneKey: 100 calls with one key at the same moment over loopback
// gRPC run the handler once; every other call gets a replay or Aborted.
func TestConcurrentOneKey(t *testing.T) {
	t.Parallel()
	c := &counter{delay: 300 * time.Millisecond}
	addr := serve(t, newServer(t, memstore.New(nil), nil), &ordersService{create: c.create})
	cc := dial(t, addr)
	ctx := context.Background()
	out := race(t, func(key string, in *structpb.Struct) outcome {
		return invoke(ctx, cc, createMethod, key, "t1", in)
	}, 100, "race-key", mustStruct(t, map[string]any{"cart": "c1"}))
	if n := c.n.Load(); n != 1 {
		t.Fatalf("the handler ran %d times for one key, want 1", n)
	}
	judgeRace(t, out)
	// After the race: a replay of the one execution.
	o := invoke(ctx, cc, createMethod, "race-key", "t1", mustStruct(t, map[string]any{"cart": "c1"}))
	if o.err != nil || !o.replayed || o.resp.GetFields()["id"].GetNumberValue() != 1 {
		t.Fatalf("call after the race = %v, replayed %v, %v; want the replay of id 1", o.resp, o.replayed, o.err)
	}
}

// TestReplayAndMapping covers each answer of the interceptor.
func TestReplayAndMapping(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c := &counter{}
	var failed atomic.Int64
	svc := &ordersService{create: c.create, get: func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		failed.Add(1)
		st, _ := status.New(codes.FailedPrecondition, "cart is empty").WithDetails(&errdetails.ErrorInfo{Reason: "CART_EMPTY", Domain: "shop.example"})
		return nil, st.Err()
	}}
	addr := serve(t, newServer(t, memstore.New(nil), nil), svc)
	cc := dial(t, addr)
	in := mustStruct(t, map[string]any{"cart": "c1"})

	first := invoke(ctx, cc, createMethod, "k1", "t1", in)
	again := invoke(ctx, cc, createMethod, "k1", "t1", in)
	if first.err != nil || first.replayed || again.err != nil || !again.replayed || !proto.Equal(first.resp, again.resp) {
		t.Fatalf("first %v (replayed %v, %v), again %v (replayed %v, %v); want a fresh answer, then its replay", first.resp, first.replayed, first.err, again.resp, again.replayed, again.err)
	}

	t.Run("changed message", func(t *testing.T) {
		o := invoke(ctx, cc, createMethod, "k1", "t1", mustStruct(t, map[string]any{"cart": "c2"}))
		if status.Code(o.err) != codes.FailedPrecondition || errorInfoReason(o.err) != "IDEMPOTENCY_KEY_REUSED" {
			t.Fatalf("same key, other message: %v (reason %q); want FailedPrecondition IDEMPOTENCY_KEY_REUSED", o.err, errorInfoReason(o.err))
		}
	})
	t.Run("other tenant", func(t *testing.T) {
		o := invoke(ctx, cc, createMethod, "k1", "t2", in)
		if o.err != nil || o.replayed || proto.Equal(o.resp, first.resp) {
			t.Fatalf("tenant t2 with t1's key: %v (replayed %v, %v); want its own execution", o.resp, o.replayed, o.err)
		}
	})
	t.Run("invalid key", func(t *testing.T) {
		o := invoke(ctx, cc, createMethod, "bad key", "t1", in)
		if status.Code(o.err) != codes.InvalidArgument || errorInfoReason(o.err) != "IDEMPOTENCY_KEY_INVALID" {
			t.Fatalf("invalid key: %v; want InvalidArgument IDEMPOTENCY_KEY_INVALID", o.err)
		}
	})
	t.Run("no key passes through", func(t *testing.T) {
		before := c.n.Load()
		a, b := invoke(ctx, cc, createMethod, "", "t1", in), invoke(ctx, cc, createMethod, "", "t1", in)
		if a.err != nil || b.err != nil || a.replayed || b.replayed || c.n.Load() != before+2 {
			t.Fatalf("two calls without a key: %v, %v, %d executions; want both to run", a.err, b.err, c.n.Load()-before)
		}
	})
	t.Run("stored error status", func(t *testing.T) {
		a := invoke(ctx, cc, getMethod, "k-err", "t1", in)
		b := invoke(ctx, cc, getMethod, "k-err", "t1", in)
		sa, sb := status.Convert(a.err), status.Convert(b.err)
		if failed.Load() != 1 || a.replayed || !b.replayed || !proto.Equal(sa.Proto(), sb.Proto()) || errorInfoReason(b.err) != "CART_EMPTY" {
			t.Fatalf("error twice: %v (replayed %v), %v (replayed %v), handler ran %d times; want the stored status with its details replayed", sa.Proto(), a.replayed, sb.Proto(), b.replayed, failed.Load())
		}
	})
}

// TestMethodList: a listed method needs a key; an unlisted one passes through
// even with a key.
func TestMethodList(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	c, g := &counter{}, &counter{}
	addr := serve(t, newServer(t, memstore.New(nil), &idemgrpc.Config{Methods: []string{createMethod}}), &ordersService{create: c.create, get: g.create})
	cc := dial(t, addr)
	in := mustStruct(t, map[string]any{"cart": "c1"})
	o := invoke(ctx, cc, createMethod, "", "t1", in)
	if status.Code(o.err) != codes.InvalidArgument || errorInfoReason(o.err) != "IDEMPOTENCY_KEY_MISSING" || c.n.Load() != 0 {
		t.Fatalf("listed method without a key: %v, %d executions; want InvalidArgument IDEMPOTENCY_KEY_MISSING, none", o.err, c.n.Load())
	}
	a, b := invoke(ctx, cc, getMethod, "k", "t1", in), invoke(ctx, cc, getMethod, "k", "t1", in)
	if a.err != nil || b.err != nil || b.replayed || g.n.Load() != 2 {
		t.Fatalf("unlisted method twice with one key: %v, %v, replayed %v, %d executions; want 2", a.err, b.err, b.replayed, g.n.Load())
	}
	if _, err := idemgrpc.NewServer(memstore.New(nil), &idemgrpc.Config{Methods: []string{"Create"}}); err == nil {
		t.Fatal("NewServer accepted the method name \"Create\"; want an error asking for /package.Service/Method")
	}
}

// downStore fails every claim, as an unreachable database does.
type downStore struct{ *memstore.Store }

func (downStore) Claim(context.Context, idem.ClaimRequest) (*idem.Record, bool, error) {
	return nil, false, errors.New("connection refused")
}

func TestStoreDown(t *testing.T) {
	t.Parallel()
	c := &counter{}
	addr := serve(t, newServer(t, downStore{memstore.New(nil)}, nil), &ordersService{create: c.create})
	o := invoke(context.Background(), dial(t, addr), createMethod, "k", "t1", mustStruct(t, map[string]any{"cart": "c"}))
	d, ok := idemgrpc.RetryDelay(o.err)
	if status.Code(o.err) != codes.Unavailable || errorInfoReason(o.err) != "IDEMPOTENCY_STORE_UNAVAILABLE" || !ok || d <= 0 || c.n.Load() != 0 {
		t.Fatalf("store down: %v (retry %v %v), %d executions; want Unavailable IDEMPOTENCY_STORE_UNAVAILABLE with a RetryInfo, no execution", o.err, d, ok, c.n.Load())
	}
}

// TestKeepFunc: an Unavailable from the handler is stored under 503, so a
// KeepFunc that refuses 5xx lets the retry run again.
func TestKeepFunc(t *testing.T) {
	t.Parallel()
	var n atomic.Int64
	create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		if n.Add(1) == 1 {
			return nil, status.Error(codes.Unavailable, "inventory service down")
		}
		return structpb.NewStruct(map[string]any{"ok": true})
	}
	cfg := &idemgrpc.Config{Idem: &idem.Config{KeepFunc: func(s int) bool { return s < 500 }}}
	addr := serve(t, newServer(t, memstore.New(nil), cfg), &ordersService{create: create})
	cc := dial(t, addr)
	in := mustStruct(t, map[string]any{"cart": "c"})
	a, b := invoke(context.Background(), cc, createMethod, "k", "", in), invoke(context.Background(), cc, createMethod, "k", "", in)
	if status.Code(a.err) != codes.Unavailable || b.err != nil || b.replayed || n.Load() != 2 {
		t.Fatalf("Unavailable then retry: %v, %v (replayed %v), %d executions; want the retry to run again", a.err, b.err, b.replayed, n.Load())
	}
	if got := idemgrpc.HTTPStatus(codes.Unavailable); got != 503 {
		t.Fatalf("HTTPStatus(Unavailable) = %d", got)
	}
}
