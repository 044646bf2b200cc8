package idemgrpc_test

import (
	"context"
	"net"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
)

// The test service, without protoc: idemtest.Orders with the unary methods
// Create and Get, both google.protobuf.Struct → google.protobuf.Struct.
const (
	createMethod = "/idemtest.Orders/Create"
	getMethod    = "/idemtest.Orders/Get"
)

type handlerFunc func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error)

type ordersService struct{ create, get handlerFunc }

func methodHandler(full string, pick func(*ordersService) handlerFunc) grpc.MethodHandler {
	return func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
		in := new(structpb.Struct)
		if err := dec(in); err != nil {
			return nil, err
		}
		h := pick(srv.(*ordersService))
		if h == nil {
			return nil, status.Error(codes.Unimplemented, full+" is not served")
		}
		if interceptor == nil {
			return h(ctx, in)
		}
		return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: full}, func(ctx context.Context, req any) (any, error) {
			return h(ctx, req.(*structpb.Struct))
		})
	}
}

var ordersDesc = grpc.ServiceDesc{
	ServiceName: "idemtest.Orders",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{
		{MethodName: "Create", Handler: methodHandler(createMethod, func(s *ordersService) handlerFunc { return s.create })},
		{MethodName: "Get", Handler: methodHandler(getMethod, func(s *ordersService) handlerFunc { return s.get })},
	},
	Metadata: "idemtest.proto",
}

// tenantAuth is the authentication interceptor in front of idem: the "tenant"
// metadata entry is the scope (a stand-in for a verified token).
func tenantAuth(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if t := md.Get("tenant"); len(t) == 1 {
		ctx = idem.WithScope(ctx, t[0])
	}
	return handler(ctx, req)
}

// serve starts a gRPC server on a loopback port with the interceptors first,
// then tenantAuth and, when s is not nil, the idem interceptor in front of svc;
// it returns the address.
func serve(t testing.TB, s *idemgrpc.Server, svc *ordersService, first ...grpc.UnaryServerInterceptor) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	chain := append(first, tenantAuth)
	if s != nil {
		chain = append(chain, s.UnaryInterceptor())
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(chain...))
	gs.RegisterService(&ordersDesc, svc)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	return ln.Addr().String()
}

func dial(t testing.TB, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// outcome is what one call got.
type outcome struct {
	resp     *structpb.Struct
	err      error
	replayed bool
}

// invoke calls method with in, the key (none when empty) and the tenant.
func invoke(ctx context.Context, cc *grpc.ClientConn, method, key, tenant string, in *structpb.Struct, opts ...grpc.CallOption) outcome {
	var pairs []string
	if key != "" {
		pairs = append(pairs, idemgrpc.MetadataKey, key)
	}
	if tenant != "" {
		pairs = append(pairs, "tenant", tenant)
	}
	ctx = metadata.AppendToOutgoingContext(ctx, pairs...)
	var hdr metadata.MD
	out := new(structpb.Struct)
	err := cc.Invoke(ctx, method, in, out, append(opts, grpc.Header(&hdr))...)
	if err != nil {
		out = nil
	}
	return outcome{resp: out, err: err, replayed: idemgrpc.Replayed(hdr)}
}

func mustStruct(t testing.TB, m map[string]any) *structpb.Struct {
	t.Helper()
	s, err := structpb.NewStruct(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}
