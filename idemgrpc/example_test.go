package idemgrpc_test

import (
	"context"
	"fmt"
	"log"
	"net"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
)

// auth stands for the interceptor that authenticates the caller: it puts the
// tenant into the context with idem.WithScope, in front of idem.
func auth(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("tenant")) == 1 {
		ctx = idem.WithScope(ctx, md.Get("tenant")[0])
	}
	return handler(ctx, req)
}

// A gRPC server whose unary methods are idempotent under the idempotency-key
// metadata entry, and a client that keys every call.
func Example() {
	// The server: authentication, then idem, in front of the service.
	keys, err := idemgrpc.NewServer(memstore.New(nil), nil) // or sqlitestore / pgstore / …
	if err != nil {
		log.Fatal(err)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(auth, keys.UnaryInterceptor()),
		grpc.ChainStreamInterceptor(keys.StreamInterceptor())) // refuses keyed streams
	orders := 0
	srv.RegisterService(&ordersDesc, &ordersService{create: func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		orders++ // with a SQL store: insert through pgstore.Tx(ctx) / sqlitestore.Tx(ctx)
		return structpb.NewStruct(map[string]any{"id": fmt.Sprintf("ord_%d", orders)})
	}})
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		log.Fatal(err)
	}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Stop()

	// The client: one key per call, the same on every retry of it.
	conn, err := grpc.NewClient(ln.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(idemgrpc.UnaryClientInterceptor(nil)))
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()

	ctx := metadata.AppendToOutgoingContext(context.Background(), "tenant", "t1")
	ctx = idemgrpc.WithKey(ctx, "order-42") // here: to show a retry by hand
	in, _ := structpb.NewStruct(map[string]any{"cart": "c_42"})
	for range 2 {
		var header metadata.MD
		out := new(structpb.Struct)
		if err := conn.Invoke(ctx, "/idemtest.Orders/Create", in, out, grpc.Header(&header)); err != nil {
			log.Fatal(err)
		}
		fmt.Println(out.GetFields()["id"].GetStringValue(), "replayed:", idemgrpc.Replayed(header))
	}
	fmt.Println("orders:", orders)
	// Output:
	// ord_1 replayed: false
	// ord_1 replayed: true
	// orders: 1
}
