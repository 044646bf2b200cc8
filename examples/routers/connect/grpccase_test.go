package main

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// TestGRPCRefusedWhateverTheCase: connect serves Application/GRPC and
// APPLICATION/GRPC+PROTO as gRPC (it matches media types without regard to
// case). Before, only the lower-case spelling was refused: the others placed
// the order and stored its answer without the status trailers. Each is
// refused with Unimplemented (12) over HTTP/2, placing no order.
func TestGRPCRefusedWhateverTheCase(t *testing.T) {
	t.Parallel()
	orders := &shop.Orders{}
	mux, err := newMux(memstore.New(nil), orders)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(tr.CloseIdleConnections)
	in, _ := structpb.NewStruct(map[string]any{"cart_id": "c_grpc", "total_cents": 1900})
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(in)
	if err != nil {
		t.Fatal(err)
	}
	for _, ct := range []string{"Application/GRPC", "APPLICATION/GRPC+PROTO", "application/grpc+proto"} {
		req, _ := http.NewRequest("POST", srv.URL+CreateOrderProcedure, bytes.NewReader(frame(b)))
		req.Header.Set("Content-Type", ct)
		req.Header.Set("TE", "trailers")
		req.Header.Set("Authorization", "Bearer t1")
		req.Header.Set("Idempotency-Key", "k-case")
		resp, err := (&http.Client{Transport: tr}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		code := resp.Trailer.Get("Grpc-Status")
		if code == "" {
			code = resp.Header.Get("Grpc-Status")
		}
		if code != "12" || len(orders.List("t1", "")) != 0 {
			t.Fatalf("gRPC call with Content-Type %q: grpc-status %q, %d orders; want 12 (Unimplemented) and no order", ct, code, len(orders.List("t1", "")))
		}
	}
}
