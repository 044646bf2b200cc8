// Command connect serves the Connect RPC shop.v1.OrderService/CreateOrder
// (connectrpc.com/connect, over net/http) with idem in front of the Connect
// handler and the tenant from an HTTP authentication middleware.
//
//	go run ./examples/routers/connect
//
// Connect handlers are http.Handlers, so idem wraps them like any other: a
// Connect-protocol unary call is a POST whose body is the request message (JSON
// or binary protobuf) and whose headers are its metadata, so the key travels in
// the Idempotency-Key header and the answer — message or Connect error — is
// stored and replayed byte for byte. Authentication must run in front of idem,
// at the HTTP level (like connectrpc.com/authn), not in a Connect interceptor,
// which runs inside the handler, after idem. The gRPC and gRPC-Web protocols of
// the same handler end their answers in trailers, which idem does not store:
// serve them with idemgrpc on a grpc-go server, or key only Connect-protocol
// calls.
//
// The messages are google.protobuf.Struct, so the example needs no generated
// code; a real service uses its generated types the same way.
package main

import (
	"context"
	"encoding/json"
	"log"
	"net/http"
	"time"

	"connectrpc.com/connect"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/protobuf/types/known/structpb"
)

// CreateOrderProcedure is the Connect procedure, served at this path.
const CreateOrderProcedure = "/shop.v1.OrderService/CreateOrder"

func newMux(store idem.Store, orders *shop.Orders) (*http.ServeMux, error) {
	protect, err := idem.New(store, nil)
	if err != nil {
		return nil, err
	}
	create := connect.NewUnaryHandler(CreateOrderProcedure, func(ctx context.Context, req *connect.Request[structpb.Struct]) (*connect.Response[structpb.Struct], error) {
		f := req.Msg.GetFields()
		ord, err := orders.Create(idem.ScopeFrom(ctx), shop.NewOrder{
			CartID: f["cart_id"].GetStringValue(), TotalCents: int64(f["total_cents"].GetNumberValue()),
		})
		if err != nil {
			return nil, connect.NewError(connect.CodeInvalidArgument, err)
		}
		msg, err := structpb.NewStruct(map[string]any{"id": ord.ID, "cart_id": ord.CartID, "total_cents": float64(ord.TotalCents)})
		if err != nil {
			return nil, connect.NewError(connect.CodeInternal, err)
		}
		return connect.NewResponse(msg), nil
	})
	mux := http.NewServeMux()
	mux.Handle("POST "+CreateOrderProcedure, shop.Auth(protect(create)))
	mux.Handle("GET /orders", shop.Auth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string][]shop.Order{"orders": orders.List(idem.ScopeFrom(r.Context()), r.URL.Query().Get("cart_id"))})
	})))
	return mux, nil
}

func main() {
	mux, err := newMux(memstore.New(nil), &shop.Orders{Delay: 100 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	log.Println("Connect example: listening on http://127.0.0.1:8080" + CreateOrderProcedure)
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", mux))
}
