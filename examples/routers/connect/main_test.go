package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/idemkit/idem/examples/routers/internal/routertest"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

func start(t *testing.T, delay time.Duration) *httptest.Server {
	t.Helper()
	mux, err := newMux(memstore.New(nil), &shop.Orders{Delay: delay})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv
}

// TestIdemCheck runs every case of idem check against the Connect procedure
// (Connect protocol, JSON body).
func TestIdemCheck(t *testing.T) {
	srv := start(t, 50*time.Millisecond)
	routertest.Check(t, srv.URL+CreateOrderProcedure, srv.URL+"/orders?cart_id={{marker}}")
}

// TestConnectClient: a connect-go client with its default binary codec
// (which encodes the Struct's map in a new order on every call) retrying with
// one key gets the same message back, marked as a replay.
func TestConnectClient(t *testing.T) {
	srv := start(t, 0)
	client := connect.NewClient[structpb.Struct, structpb.Struct](http.DefaultClient, srv.URL+CreateOrderProcedure)
	in, _ := structpb.NewStruct(map[string]any{"cart_id": "c_42", "total_cents": 1900})
	call := func() *connect.Response[structpb.Struct] {
		req := connect.NewRequest(in)
		req.Header().Set("Authorization", "Bearer t1")
		req.Header().Set("Idempotency-Key", "connect-key-1")
		resp, err := client.CallUnary(context.Background(), req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	a, b := call(), call()
	if a.Header().Get("Idempotent-Replayed") != "" || b.Header().Get("Idempotent-Replayed") != "true" || !proto.Equal(a.Msg, b.Msg) {
		t.Fatalf("two calls with one key: %v then %v (replayed %q); want the same order, the second a replay", a.Msg, b.Msg, b.Header().Get("Idempotent-Replayed"))
	}
}

// deterministicProto is connect's binary protobuf codec with deterministic map
// order, so that every attempt of a call sends the same bytes.
type deterministicProto struct{}

func (deterministicProto) Name() string { return "proto" }

func (deterministicProto) Marshal(m any) ([]byte, error) {
	return proto.MarshalOptions{Deterministic: true}.Marshal(m.(proto.Message))
}

func (deterministicProto) Unmarshal(b []byte, m any) error {
	return proto.Unmarshal(b, m.(proto.Message))
}
