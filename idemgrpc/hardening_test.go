package idemgrpc_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
)

// rawCodec sends a request's bytes as they are, the way a client's own codec
// may have encoded them, and reads the response as bytes.
type rawCodec struct{}

type rawMsg struct{ b []byte }

func (rawCodec) Marshal(v any) ([]byte, error) { return v.(*rawMsg).b, nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	v.(*rawMsg).b = append([]byte(nil), data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

// invokeRaw calls method with the request bytes b and the key.
func invokeRaw(cc *grpc.ClientConn, method, key string, b []byte) (replayed bool, err error) {
	ctx := metadata.AppendToOutgoingContext(context.Background(), idemgrpc.MetadataKey, key, "tenant", "t1")
	var hdr metadata.MD
	err = cc.Invoke(ctx, method, &rawMsg{b}, &rawMsg{}, grpc.ForceCodec(rawCodec{}), grpc.Header(&hdr))
	return idemgrpc.Replayed(hdr), err
}

// newerStruct is google.protobuf.Struct as a client built from a newer .proto
// sees it: the same fields (1), plus map<string, string> labels = 9, which
// the server does not know.
func newerStruct(t *testing.T) protoreflect.MessageDescriptor {
	t.Helper()
	s, l, o := descriptorpb.FieldDescriptorProto_TYPE_STRING, descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL, descriptorpb.FieldDescriptorProto_LABEL_REPEATED
	msgT := descriptorpb.FieldDescriptorProto_TYPE_MESSAGE
	entry := func(name string, val *descriptorpb.FieldDescriptorProto) *descriptorpb.DescriptorProto {
		return &descriptorpb.DescriptorProto{
			Name: proto.String(name),
			Field: []*descriptorpb.FieldDescriptorProto{
				{Name: proto.String("key"), Number: proto.Int32(1), Type: &s, Label: &l},
				val,
			},
			Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)},
		}
	}
	fdp := &descriptorpb.FileDescriptorProto{
		Name: proto.String("idemtest/newer.proto"), Package: proto.String("idemtest.v2"), Syntax: proto.String("proto3"),
		Dependency: []string{"google/protobuf/struct.proto"},
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: proto.String("Struct"),
			Field: []*descriptorpb.FieldDescriptorProto{
				{Name: proto.String("fields"), Number: proto.Int32(1), Type: &msgT, Label: &o, TypeName: proto.String(".idemtest.v2.Struct.FieldsEntry")},
				{Name: proto.String("labels"), Number: proto.Int32(9), Type: &msgT, Label: &o, TypeName: proto.String(".idemtest.v2.Struct.LabelsEntry")},
			},
			NestedType: []*descriptorpb.DescriptorProto{
				entry("FieldsEntry", &descriptorpb.FieldDescriptorProto{Name: proto.String("value"), Number: proto.Int32(2), Type: &msgT, Label: &l, TypeName: proto.String(".google.protobuf.Value")}),
				entry("LabelsEntry", &descriptorpb.FieldDescriptorProto{Name: proto.String("value"), Number: proto.Int32(2), Type: &s, Label: &l}),
			},
		}},
	}
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	if err != nil {
		t.Fatal(err)
	}
	return fd.Messages().ByName("Struct")
}

// mapEntry encodes one entry of the map field num: key → value (a string).
func mapEntry(num protowire.Number, key, value string) []byte {
	var e []byte
	e = protowire.AppendTag(e, 1, protowire.BytesType)
	e = protowire.AppendString(e, key)
	e = protowire.AppendTag(e, 2, protowire.BytesType)
	e = protowire.AppendString(e, value)
	b := protowire.AppendTag(nil, num, protowire.BytesType)
	return protowire.AppendBytes(b, e)
}

// structValueEntry encodes one entry of Struct.fields: key → string value.
func structValueEntry(key, value string) []byte {
	v, _ := proto.Marshal(structpb.NewStringValue(value))
	var e []byte
	e = protowire.AppendTag(e, 1, protowire.BytesType)
	e = protowire.AppendString(e, key)
	e = protowire.AppendTag(e, 2, protowire.BytesType)
	e = protowire.AppendBytes(e, v)
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	return protowire.AppendBytes(b, e)
}

func concat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

// sameMeaning checks that a and b, decoded as md, are proto.Equal and differ
// in bytes: one message, two encodings.
func sameMeaning(t *testing.T, md protoreflect.MessageDescriptor, a, b []byte) {
	t.Helper()
	ma, mb := dynamicpb.NewMessage(md), dynamicpb.NewMessage(md)
	if err := proto.Unmarshal(a, ma); err != nil {
		t.Fatal(err)
	}
	if err := proto.Unmarshal(b, mb); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(ma, mb) || bytes.Equal(a, b) {
		t.Fatalf("test setup: the two encodings must be one message (proto.Equal %v) in different bytes (equal bytes %v)", proto.Equal(ma, mb), bytes.Equal(a, b))
	}
}

// TestFingerprintUnknownMapInAnyOrder: a client built from a newer .proto
// sends a map field the server does not know (an unknown field to it), its
// entries in another order on the retry — grpc-go's codec encodes maps in no
// fixed order. The retry is the same message (proto.Equal for the client's
// type) and gets the replay, not FailedPrecondition IDEMPOTENCY_KEY_REUSED;
// the same key with another label value is still refused; with
// KnownFieldsOnly it is not.
func TestFingerprintUnknownMapInAnyOrder(t *testing.T) {
	t.Parallel()
	md := newerStruct(t)
	known := concat(structValueEntry("cart", "c1"), structValueEntry("note", "n"))
	knownSwapped := concat(structValueEntry("note", "n"), structValueEntry("cart", "c1"))
	a := concat(known, mapEntry(9, "region", "eu"), mapEntry(9, "tier", "gold"))
	b := concat(mapEntry(9, "tier", "gold"), knownSwapped, mapEntry(9, "region", "eu"))
	other := concat(known, mapEntry(9, "region", "us"), mapEntry(9, "tier", "gold"))
	sameMeaning(t, md, a, b)

	for _, knownOnly := range []bool{false, true} {
		t.Run(fmt.Sprintf("KnownFieldsOnly=%v", knownOnly), func(t *testing.T) {
			t.Parallel()
			c := &counter{}
			addr := serve(t, newServer(t, memstore.New(nil), &idemgrpc.Config{KnownFieldsOnly: knownOnly}), &ordersService{create: c.create})
			cc := dial(t, addr)
			key := "k-unknown-map"
			if rep, err := invokeRaw(cc, createMethod, key, a); err != nil || rep {
				t.Fatalf("first call: %v (replayed %v)", err, rep)
			}
			rep, err := invokeRaw(cc, createMethod, key, b)
			if err != nil || !rep || c.n.Load() != 1 {
				t.Fatalf("retry of the same message in other bytes: %v (replayed %v), %d executions; want the replay of the one execution", err, rep, c.n.Load())
			}
			_, err = invokeRaw(cc, createMethod, key, other)
			switch {
			case knownOnly && err != nil:
				t.Fatalf("KnownFieldsOnly, another value of an unknown field: %v; want the replay", err)
			case !knownOnly && (status.Code(err) != codes.FailedPrecondition || errorInfoReason(err) != "IDEMPOTENCY_KEY_REUSED"):
				t.Fatalf("same key, another value of the unknown map: %v; want FailedPrecondition IDEMPOTENCY_KEY_REUSED", err)
			}
		})
	}
}

// The Any service: idemtest.Anys/Put takes a google.protobuf.Any.
const putMethod = "/idemtest.Anys/Put"

type anyService struct{ n atomic.Int64 }

var anysDesc = grpc.ServiceDesc{
	ServiceName: "idemtest.Anys",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{MethodName: "Put", Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
		in := new(anypb.Any)
		if err := dec(in); err != nil {
			return nil, err
		}
		h := func(ctx context.Context, req any) (any, error) {
			n := srv.(*anyService).n.Add(1)
			return structpb.NewStruct(map[string]any{"n": float64(n)})
		}
		if interceptor == nil {
			return h(ctx, in)
		}
		return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: putMethod}, h)
	}}},
	Metadata: "idemtest.proto",
}

func serveAnys(t *testing.T, s *idemgrpc.Server, svc *anyService) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer(grpc.ChainUnaryInterceptor(tenantAuth, s.UnaryInterceptor()))
	gs.RegisterService(&anysDesc, svc)
	go func() { _ = gs.Serve(ln) }()
	t.Cleanup(gs.Stop)
	return ln.Addr().String()
}

func anyBytes(t *testing.T, url string, value []byte) []byte {
	t.Helper()
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(&anypb.Any{TypeUrl: url, Value: value})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestFingerprintAnyPackedAfresh: a google.protobuf.Any packed afresh per
// attempt (anypb.New encodes the inner maps in no fixed order) carries the
// same message in other bytes. With the inner type known to the server
// (Struct) and unknown to it, the retry gets the replay; another inner
// message under the key is refused.
func TestFingerprintAnyPackedAfresh(t *testing.T) {
	t.Parallel()
	inner := concat(structValueEntry("cart", "c1"), structValueEntry("note", "n"))
	innerSwapped := concat(structValueEntry("note", "n"), structValueEntry("cart", "c1"))
	innerOther := concat(structValueEntry("cart", "c2"), structValueEntry("note", "n"))
	sameMeaning(t, (&structpb.Struct{}).ProtoReflect().Descriptor(), inner, innerSwapped)
	for _, url := range []string{"type.googleapis.com/google.protobuf.Struct", "type.googleapis.com/idemtest.NotRegistered"} {
		t.Run(url, func(t *testing.T) {
			t.Parallel()
			svc := &anyService{}
			cc := dial(t, serveAnys(t, newServer(t, memstore.New(nil), nil), svc))
			a, b, other := anyBytes(t, url, inner), anyBytes(t, url, innerSwapped), anyBytes(t, url, innerOther)
			if bytes.Equal(a, b) {
				t.Fatal("test setup: the two Any encodings must differ in bytes")
			}
			if _, err := invokeRaw(cc, putMethod, "k-any", a); err != nil {
				t.Fatal(err)
			}
			rep, err := invokeRaw(cc, putMethod, "k-any", b)
			if err != nil || !rep || svc.n.Load() != 1 {
				t.Fatalf("the same Any packed afresh: %v (replayed %v), %d executions; want the replay", err, rep, svc.n.Load())
			}
			if _, err := invokeRaw(cc, putMethod, "k-any", other); status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("another message in the Any under the key: %v; want FailedPrecondition", err)
			}
		})
	}
}

// TestRetryCodesNotKept: a handler's Unavailable, ResourceExhausted, Aborted,
// DeadlineExceeded or Canceled tells the client to retry; kept, every retry
// with the key would hear it for the TTL and the order would never be placed.
// By default they are not kept: the retry runs the method again. Codes that
// are answers (AlreadyExists, shares 409 with Aborted) are kept, and so is a
// retry code whose KeepCode keeps it. A KeepFunc "s < 500" does not keep
// Canceled (HTTP 499) either.
func TestRetryCodesNotKept(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		code codes.Code
		cfg  *idemgrpc.Config
		kept bool
	}{
		{codes.Unavailable, nil, false},
		{codes.ResourceExhausted, nil, false},
		{codes.Aborted, nil, false},
		{codes.DeadlineExceeded, nil, false},
		{codes.Canceled, &idemgrpc.Config{Idem: &idem.Config{KeepFunc: func(s int) bool { return s < 500 }}}, false},
		{codes.AlreadyExists, nil, true},
		{codes.InvalidArgument, nil, true},
		{codes.Unavailable, &idemgrpc.Config{KeepCode: func(codes.Code) bool { return true }}, true},
	} {
		t.Run(fmt.Sprintf("%v/custom=%v", tc.code, tc.cfg != nil), func(t *testing.T) {
			t.Parallel()
			var n atomic.Int64
			create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
				if n.Add(1) == 1 {
					return nil, status.Error(tc.code, "first attempt fails")
				}
				return structpb.NewStruct(map[string]any{"ok": true})
			}
			cc := dial(t, serve(t, newServer(t, memstore.New(nil), tc.cfg), &ordersService{create: create}))
			in := mustStruct(t, map[string]any{"cart": "c"})
			first := invoke(context.Background(), cc, createMethod, "k-code", "t1", in)
			if status.Code(first.err) != tc.code {
				t.Fatalf("first call: %v; want the handler's %v", first.err, tc.code)
			}
			retry := invoke(context.Background(), cc, createMethod, "k-code", "t1", in)
			if tc.kept {
				if status.Code(retry.err) != tc.code || !retry.replayed || n.Load() != 1 {
					t.Fatalf("retry: %v (replayed %v), %d executions; want the kept %v replayed", retry.err, retry.replayed, n.Load(), tc.code)
				}
				return
			}
			if retry.err != nil || retry.replayed || n.Load() != 2 {
				t.Fatalf("retry after %v: %v (replayed %v), %d executions; want a fresh run (the retry code not kept)", tc.code, retry.err, retry.replayed, n.Load())
			}
		})
	}
}

// TestInFlightPushback: the in-flight answer carries grpc-retry-pushback-ms
// with the RetryInfo delay, so that grpc-go's built-in retry waits out the
// lease instead of spending its attempts.
func TestInFlightPushback(t *testing.T) {
	t.Parallel()
	started, gate := make(chan struct{}), make(chan struct{})
	create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		close(started)
		<-gate
		return structpb.NewStruct(map[string]any{"ok": true})
	}
	cc := dial(t, serve(t, newServer(t, memstore.New(nil), &idemgrpc.Config{Idem: &idem.Config{Lease: 30 * time.Second}}), &ordersService{create: create}))
	in := mustStruct(t, map[string]any{"cart": "c"})
	done := make(chan outcome, 1)
	go func() { done <- invoke(context.Background(), cc, createMethod, "k-push", "t1", in) }()
	<-started
	var trailer metadata.MD
	second := invoke(context.Background(), cc, createMethod, "k-push", "t1", in, grpc.Trailer(&trailer))
	close(gate)
	<-done
	d, ok := idemgrpc.RetryDelay(second.err)
	if status.Code(second.err) != codes.Aborted || !ok {
		t.Fatalf("second call while the first runs: %v; want Aborted with a RetryInfo", second.err)
	}
	got := trailer.Get(idemgrpc.PushbackKey)
	if len(got) != 1 || got[0] != strconv.FormatInt(d.Milliseconds(), 10) {
		t.Fatalf("trailer %s = %q; want [%d] (the RetryInfo delay %v)", idemgrpc.PushbackKey, got, d.Milliseconds(), d)
	}
	if ms, _ := strconv.Atoi(got[0]); ms < 1000 || ms > 30000 {
		t.Fatalf("pushback %d ms; want the lease left (up to 30 s)", ms)
	}
}

// TestStreamingMethodRefused: a streaming method in Config.Methods would run
// without a key (a unary interceptor never sees it): NewServer refuses one it
// finds in the registry, and StreamInterceptor refuses the calls of one it
// could not know, and a keyed stream, over loopback; the method never runs.
func TestStreamingMethodRefused(t *testing.T) {
	t.Parallel()
	const watch = "/grpc.health.v1.Health/Watch"
	if _, err := idemgrpc.NewServer(memstore.New(nil), &idemgrpc.Config{Methods: []string{watch}}); err == nil {
		t.Fatalf("NewServer accepted the streaming %s in Methods", watch)
	}
	for _, methods := range [][]string{{watch}, nil} {
		t.Run(fmt.Sprint(methods), func(t *testing.T) {
			t.Parallel()
			s := newServer(t, memstore.New(nil), &idemgrpc.Config{Methods: methods, Files: new(protoregistry.Files)})
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			var watched atomic.Int64
			gs := grpc.NewServer(grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, h grpc.StreamHandler) error {
				return s.StreamInterceptor()(srv, ss, info, func(srv any, ss grpc.ServerStream) error {
					watched.Add(1)
					return h(srv, ss)
				})
			}))
			healthpb.RegisterHealthServer(gs, health.NewServer())
			go func() { _ = gs.Serve(ln) }()
			t.Cleanup(gs.Stop)
			client := healthpb.NewHealthClient(dial(t, ln.Addr().String()))
			ctx := context.Background()
			if methods == nil {
				ctx = metadata.AppendToOutgoingContext(ctx, idemgrpc.MetadataKey, "k-stream")
			}
			st, err := client.Watch(ctx, &healthpb.HealthCheckRequest{})
			if err == nil {
				_, err = st.Recv()
			}
			if status.Code(err) != codes.Unimplemented || watched.Load() != 0 {
				t.Fatalf("stream call of %s: %v, ran %d times; want Unimplemented without running", watch, err, watched.Load())
			}
		})
	}
}

// TestScopeFuncSeesMetadata: a custom Idem.ScopeFunc that reads a header
// gets the call's metadata; before, the synthetic request had none and every
// tenant shared one scope (tenant B's call with tenant A's key was refused as
// a key reuse, or got A's answer).
func TestScopeFuncSeesMetadata(t *testing.T) {
	t.Parallel()
	c := &counter{}
	scope := func(r *http.Request) string { return r.Header.Get("X-Tenant") }
	cc := dial(t, serve(t, newServer(t, memstore.New(nil), &idemgrpc.Config{Idem: &idem.Config{ScopeFunc: scope}}), &ordersService{create: c.create}))
	call := func(tenant, cart string) outcome {
		ctx := metadata.AppendToOutgoingContext(context.Background(), "x-tenant", tenant)
		return invoke(ctx, cc, createMethod, "k-shared", "", mustStruct(t, map[string]any{"cart": cart}))
	}
	a, b := call("acme", "a"), call("globex", "b")
	if a.err != nil || b.err != nil || b.replayed || c.n.Load() != 2 {
		t.Fatalf("two tenants, one key: %v / %v (replayed %v), %d executions; want two executions in two scopes", a.err, b.err, b.replayed, c.n.Load())
	}
}

// TestWithKeyOnUnlistedMethod: WithKey on a call of a method that is not in
// ClientConfig.Methods sends the key (it was silently dropped).
func TestWithKeyOnUnlistedMethod(t *testing.T) {
	t.Parallel()
	var seen atomic.Value
	get := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		md, _ := metadata.FromIncomingContext(ctx)
		seen.Store(fmt.Sprint(md.Get(idemgrpc.MetadataKey)))
		return &structpb.Struct{}, nil
	}
	addr := serve(t, nil, &ordersService{get: get})
	cc := dial(t, addr, grpc.WithChainUnaryInterceptor(idemgrpc.UnaryClientInterceptor(&idemgrpc.ClientConfig{Methods: []string{createMethod}})))
	ctx := idemgrpc.WithKey(context.Background(), "job-7")
	if err := cc.Invoke(ctx, getMethod, &structpb.Struct{}, new(structpb.Struct)); err != nil {
		t.Fatal(err)
	}
	if seen.Load() != "[job-7]" {
		t.Fatalf("key on the server: %v; want [job-7] from WithKey", seen.Load())
	}
}
