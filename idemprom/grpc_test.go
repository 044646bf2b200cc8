package idemprom_test

import (
	"context"
	"fmt"
	"net"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/memstore"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
)

// TestRouteForGRPC: over a loopback gRPC server, an interceptor in front of
// idemgrpc names the route with ContextWithRoute, and the keyed call is
// counted under its method.
func TestRouteForGRPC(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewRegistry()
	m, err := idemprom.New(reg, &idemprom.Config{Route: idemprom.RouteFrom})
	if err != nil {
		t.Fatal(err)
	}
	keys, err := idemgrpc.NewServer(memstore.New(nil), &idemgrpc.Config{Idem: &idem.Config{Observer: m}})
	if err != nil {
		t.Fatal(err)
	}
	route := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
		return h(idemprom.ContextWithRoute(ctx, info.FullMethod), req)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(route, keys.UnaryInterceptor()))
	healthpb.RegisterHealthServer(gs, health.NewServer())
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	cc, err := grpc.NewClient(ln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	ctx := metadata.AppendToOutgoingContext(context.Background(), idemgrpc.MetadataKey, "k-route")
	if _, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	const method = "/grpc.health.v1.Health/Check"
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, f := range fams {
		if f.GetName() != "idem_requests_total" {
			continue
		}
		for _, s := range f.GetMetric() {
			labels := map[string]string{}
			for _, l := range s.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			got = append(got, fmt.Sprintf("%s %s %v", labels["outcome"], labels["route"], s.GetCounter().GetValue()))
		}
	}
	if fmt.Sprint(got) != fmt.Sprint([]string{"executed " + method + " 1"}) {
		t.Fatalf("idem_requests_total series %q; want one: executed %s 1", got, method)
	}
}
