package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

func startOrders(t *testing.T) (*httptest.Server, *shop.Orders) {
	t.Helper()
	orders := &shop.Orders{}
	mux, err := newMux(memstore.New(nil), orders)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv, orders
}

// postJSON sends a Connect-protocol JSON call with the key and extra headers.
func postJSON(t *testing.T, url, key, body string, hdr map[string]string) (int, string, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+CreateOrderProcedure, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer t1")
	req.Header.Set("Idempotency-Key", key)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b strings.Builder
	buf := make([]byte, 4096)
	for {
		n, err := resp.Body.Read(buf)
		b.Write(buf[:n])
		if err != nil {
			break
		}
	}
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), b.String()
}

// TestClientDeadlineIsNotTheOutcome: a call whose Connect-Timeout-Ms has
// passed by the time connect reads it (0 ms) is claimed; the method runs to
// its end on idem's context, and the retry without a deadline gets the placed
// order — not a stored deadline_exceeded 504 that no retry could get past.
func TestClientDeadlineIsNotTheOutcome(t *testing.T) {
	t.Parallel()
	srv, orders := startOrders(t)
	body := `{"cart_id":"c_dl","total_cents":1900}`
	postJSON(t, srv.URL, "k-deadline", body, map[string]string{"Connect-Timeout-Ms": "0"})
	code, replayed, out := postJSON(t, srv.URL, "k-deadline", body, nil)
	if code != 200 || replayed != "true" || !strings.Contains(out, `"id"`) || len(orders.List("t1", "c_dl")) != 1 {
		t.Fatalf("retry after a call with a passed deadline: %d (replayed %q) %s, %d orders; want the replay of the one placed order", code, replayed, out, len(orders.List("t1", "c_dl")))
	}
}

// TestFrameworkAnswerNotStored: connect refuses a call before running the
// method (a Connect-Protocol-Version it does not speak); that answer is not
// the method's outcome and is not stored: the corrected retry with the same
// key runs the method.
func TestFrameworkAnswerNotStored(t *testing.T) {
	t.Parallel()
	srv, orders := startOrders(t)
	body := `{"cart_id":"c_fw","total_cents":1900}`
	if code, _, out := postJSON(t, srv.URL, "k-fw", body, map[string]string{"Connect-Protocol-Version": "2"}); code != 400 {
		t.Fatalf("a call with Connect-Protocol-Version 2: %d %s; want connect's 400", code, out)
	}
	code, replayed, out := postJSON(t, srv.URL, "k-fw", body, nil)
	if code != 200 || replayed != "" || len(orders.List("t1", "c_fw")) != 1 {
		t.Fatalf("corrected retry: %d (replayed %q) %s, %d orders; want a fresh run placing the order", code, replayed, out, len(orders.List("t1", "c_fw")))
	}
}

// TestGRPCWebReplay: a gRPC-Web client (connect-go, compressing) retrying
// with one key gets the same message back, and a handler error back with its
// code, both replays decodable: before, the replayed success lacked
// Grpc-Encoding and the replayed error its trailers-only status.
func TestGRPCWebReplay(t *testing.T) {
	t.Parallel()
	srv, orders := startOrders(t)
	client := connect.NewClient[structpb.Struct, structpb.Struct](http.DefaultClient, srv.URL+CreateOrderProcedure,
		connect.WithGRPCWeb(), connect.WithCodec(deterministicProto{}), connect.WithSendGzip())
	call := func(key string, in *structpb.Struct) (*connect.Response[structpb.Struct], error) {
		req := connect.NewRequest(in)
		req.Header().Set("Authorization", "Bearer t1")
		req.Header().Set("Idempotency-Key", key)
		return client.CallUnary(context.Background(), req)
	}
	in, _ := structpb.NewStruct(map[string]any{"cart_id": "c_web", "total_cents": 1900, "note": strings.Repeat("x", 2048)})
	a, errA := call("k-web", in)
	b, errB := call("k-web", in)
	if errA != nil || errB != nil {
		t.Fatalf("two gRPC-Web calls with one key: %v, %v; want the order, then its replay", errA, errB)
	}
	if b.Header().Get("Idempotent-Replayed") != "true" || !proto.Equal(a.Msg, b.Msg) || len(orders.List("t1", "c_web")) != 1 {
		t.Fatalf("replay %v (replayed %q) of %v, %d orders; want the same message, one order", b.Msg, b.Header().Get("Idempotent-Replayed"), a.Msg, len(orders.List("t1", "c_web")))
	}
	bad, _ := structpb.NewStruct(map[string]any{"cart_id": "c_bad"})
	_, errA = call("k-web-bad", bad)
	_, errB = call("k-web-bad", bad)
	if connect.CodeOf(errA) != connect.CodeInvalidArgument || connect.CodeOf(errB) != connect.CodeInvalidArgument {
		t.Fatalf("a handler error and its replay over gRPC-Web: %v / %v; want InvalidArgument twice", errA, errB)
	}
}

// TestGRPCRefused: a gRPC call (HTTP/2, status in trailers idem does not
// store) is refused with Unimplemented and places no order, rather than
// stored without its status.
func TestGRPCRefused(t *testing.T) {
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
	client := connect.NewClient[structpb.Struct, structpb.Struct](&http.Client{Transport: tr}, srv.URL+CreateOrderProcedure,
		connect.WithGRPC(), connect.WithCodec(deterministicProto{}))
	in, _ := structpb.NewStruct(map[string]any{"cart_id": "c_grpc", "total_cents": 1900})
	req := connect.NewRequest(in)
	req.Header().Set("Authorization", "Bearer t1")
	req.Header().Set("Idempotency-Key", "k-grpc")
	if _, err := client.CallUnary(context.Background(), req); connect.CodeOf(err) != connect.CodeUnimplemented || len(orders.List("t1", "")) != 0 {
		t.Fatalf("gRPC call: %v, %d orders; want Unimplemented and no order", err, len(orders.List("t1", "")))
	}
}
