package idemgrpc_test

import (
	"context"
	"fmt"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// TestEveryCodeKept: every error code a handler can return, by default and
// with an Idem.KeepFunc that keeps below 500: a kept code is replayed to the
// retry without running the method; one not kept is not stored, and the retry
// runs the method again, and the Observer hears EventReleased (outcome
// "released").
func TestEveryCodeKept(t *testing.T) {
	t.Parallel()
	for c := codes.Canceled; c <= codes.Unauthenticated; c++ {
		for _, withKeepFunc := range []bool{false, true} {
			var released atomic.Int64
			cfg := &idemgrpc.Config{Idem: &idem.Config{Observer: idem.ObserverFunc(func(_ context.Context, e idem.Event) {
				if e.Kind == idem.EventReleased {
					released.Add(1)
				}
			})}}
			if withKeepFunc {
				cfg.Idem.KeepFunc = func(s int) bool { return s < http.StatusInternalServerError }
			}
			want := idemgrpc.DefaultKeepCode(c)
			if withKeepFunc {
				want = want && idemgrpc.HTTPStatus(c) < 500
			}
			t.Run(fmt.Sprintf("%v/keepFunc=%v", c, withKeepFunc), func(t *testing.T) {
				t.Parallel()
				var n atomic.Int64
				create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
					if n.Add(1) == 1 {
						return nil, status.Error(c, "first attempt")
					}
					return structpb.NewStruct(map[string]any{"ok": true})
				}
				cc := dial(t, serve(t, newServer(t, memstore.New(nil), cfg), &ordersService{create: create}))
				in := mustStruct(t, map[string]any{"cart": "c"})
				if first := invoke(context.Background(), cc, createMethod, "k-every", "t1", in); status.Code(first.err) != c {
					t.Fatalf("first call: %v; want %v", first.err, c)
				}
				retry := invoke(context.Background(), cc, createMethod, "k-every", "t1", in)
				kept := status.Code(retry.err) == c && retry.replayed && n.Load() == 1
				fresh := retry.err == nil && !retry.replayed && n.Load() == 2
				if (want && !kept) || (!want && !fresh) {
					t.Fatalf("retry after %v: %v (replayed %v), %d runs; want kept=%v", c, retry.err, retry.replayed, n.Load(), want)
				}
				if wantReleased := map[bool]int64{true: 0, false: 1}[want]; released.Load() != wantReleased {
					t.Fatalf("%d released events after %v; want %d (the outcome %s)", released.Load(), c, wantReleased, map[bool]string{true: "stored", false: "not kept"}[want])
				}
			})
		}
	}
}

// TestHandlerTimeoutCodeNotKept: a handler that gives up when idem's
// HandlerTimeout ends its context (returning ctx.Err(): DeadlineExceeded, or
// Canceled from a context it derived) stores nothing; the retry runs again.
func TestHandlerTimeoutCodeNotKept(t *testing.T) {
	t.Parallel()
	for name, derive := range map[string]bool{"own context": false, "derived context": true} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			var n atomic.Int64
			create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
				if n.Add(1) > 1 {
					return structpb.NewStruct(map[string]any{"ok": true})
				}
				if derive {
					var cancel context.CancelFunc
					ctx, cancel = context.WithCancel(ctx)
					defer cancel()
				}
				<-ctx.Done()
				return nil, ctx.Err()
			}
			cfg := &idemgrpc.Config{Idem: &idem.Config{HandlerTimeout: 50 * time.Millisecond}}
			cc := dial(t, serve(t, newServer(t, memstore.New(nil), cfg), &ordersService{create: create}))
			in := mustStruct(t, map[string]any{"cart": "c"})
			first := invoke(context.Background(), cc, createMethod, "k-timeout", "t1", in)
			if c := status.Code(first.err); c != codes.DeadlineExceeded && c != codes.Canceled {
				t.Fatalf("first call, past HandlerTimeout: %v; want DeadlineExceeded or Canceled", first.err)
			}
			retry := invoke(context.Background(), cc, createMethod, "k-timeout", "t1", in)
			if retry.err != nil || retry.replayed || n.Load() != 2 {
				t.Fatalf("retry: %v (replayed %v), %d runs; want a fresh run", retry.err, retry.replayed, n.Load())
			}
		})
	}
}

// TestObserverPanicGoesToRecoverer: an Observer that panics on EventExecuted
// (after the outcome is committed) panics the call, as docs/grpc.md says; a
// recovery interceptor in front turns it into Internal, and the retry gets the
// stored outcome, replayed, without running the method again.
func TestObserverPanicGoesToRecoverer(t *testing.T) {
	t.Parallel()
	var fired atomic.Bool
	obs := idem.ObserverFunc(func(_ context.Context, e idem.Event) {
		if e.Kind == idem.EventExecuted && fired.CompareAndSwap(false, true) {
			panic("exporter bug")
		}
	})
	c := &counter{}
	s := newServer(t, memstore.New(nil), &idemgrpc.Config{Idem: &idem.Config{Observer: obs}})
	cc := dial(t, serve(t, s, &ordersService{create: c.create}, recoverer))
	in := mustStruct(t, map[string]any{"cart": "c"})
	if first := invoke(context.Background(), cc, createMethod, "k-obs", "t1", in); status.Code(first.err) != codes.Internal {
		t.Fatalf("call whose Observer panicked: %v; want the recovery interceptor's Internal", first.err)
	}
	retry := invoke(context.Background(), cc, createMethod, "k-obs", "t1", in)
	if retry.err != nil || !retry.replayed || c.n.Load() != 1 {
		t.Fatalf("retry: %v (replayed %v), %d runs; want the stored outcome replayed", retry.err, retry.replayed, c.n.Load())
	}
}
