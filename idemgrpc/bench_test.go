package idemgrpc_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/idemkit/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/structpb"
)

// BenchmarkUnary measures a unary call over loopback gRPC to the same handler:
// bare (no idem interceptor), through the idem interceptor on memstore with a
// new key per call (first execution), and with one key (replay). Compare each
// with bare for the interceptor's overhead: cpu-ns/op (the process's CPU time
// per call, client and server together) holds on a busy machine, where ns/op
// (wall time) does not.
//
//	go test -run '^$' -bench Unary -count 6 ./idemgrpc | benchstat -
func BenchmarkUnary(b *testing.B) {
	create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		return structpb.NewStruct(map[string]any{"id": "ord_1", "cart": in.GetFields()["cart"].GetStringValue()})
	}
	in, _ := structpb.NewStruct(map[string]any{"cart": "c_42", "total_cents": 1900})
	bare := dial(b, serve(b, nil, &ordersService{create: create}))
	keyed := dial(b, serve(b, newServer(b, memstore.New(nil), nil), &ordersService{create: create}))
	run := func(b *testing.B, cc *grpc.ClientConn, key func() string) {
		b.ReportAllocs()
		cpu0 := processCPU()
		b.RunParallel(func(pb *testing.PB) {
			ctx := context.Background()
			for pb.Next() {
				if o := invoke(ctx, cc, createMethod, key(), "t1", in); o.err != nil {
					b.Fatal(o.err)
				}
			}
		})
		b.ReportMetric(float64(processCPU()-cpu0)/float64(b.N), "cpu-ns/op")
	}
	var n atomic.Int64
	b.Run("bare", func(b *testing.B) { run(b, bare, func() string { return "" }) })
	b.Run("idem-first", func(b *testing.B) {
		run(b, keyed, func() string { return "k" + strconv.FormatInt(n.Add(1), 36) })
	})
	b.Run("idem-replay", func(b *testing.B) { run(b, keyed, func() string { return "replayed-key" }) })
}

// processCPU returns the CPU time the process has used, user and system, in ns.
func processCPU() int64 {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return ru.Utime.Nano() + ru.Stime.Nano()
}
