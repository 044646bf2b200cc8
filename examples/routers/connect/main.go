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
// which runs inside the handler, after idem.
//
// Three things keep the stored answer the method's own (keyed, below):
//
//   - The client's deadline (Connect-Timeout-Ms, Grpc-Timeout) is taken off
//     the request before idem: connect would rebuild it on idem's detached
//     context, and a claimed call must run to its end whatever the client's
//     deadline (the client enforces its deadline itself). Otherwise a deadline
//     already passed makes connect answer deadline_exceeded without running
//     the method, and that answer would be stored for the TTL.
//   - An answer connect produced without running the method (a bad protocol
//     header, an undecodable message, …) is not stored: the method marks that
//     it ran (method), and when it did not, the key is released — by a panic
//     idem answers by releasing, recovered in front of idem — and the client
//     gets connect's answer.
//   - A binary protobuf request is fingerprinted by what it means, not by the
//     bytes the client's codec chose: connect-go's default codec (like
//     grpc-go's) encodes a map in a new order on every attempt, which idem
//     would refuse as another request (422). The message is decoded with the
//     procedure's request type and re-encoded deterministically (fingerprint,
//     below); so is a JSON one (its keys in another order, other spacing).
//     The codec stays in the fingerprint: a retry in JSON of a call made in
//     protobuf is refused, never answered with protobuf bytes.
//   - gRPC-Web answers are replayed with the grpc-* headers they need
//     (Grpc-Encoding, and the status of a trailers-only error); gRPC calls, whose
//     status travels in HTTP trailers that idem does not store, are refused with
//     Unimplemented: serve gRPC with idemgrpc on a grpc-go server.
//
// The messages are google.protobuf.Struct, so the example needs no generated
// code; a real service uses its generated types the same way.
package main

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"io"
	"log"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"encoding/binary"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/examples/routers/shop"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	"mime"
)

// CreateOrderProcedure is the Connect procedure, served at this path.
const CreateOrderProcedure = "/shop.v1.OrderService/CreateOrder"

// grpcWebHeaders are the response headers a gRPC-Web answer needs on replay,
// besides idem's defaults: the message encoding and a trailers-only error's
// status.
var grpcWebHeaders = []string{"Grpc-Encoding", "Grpc-Accept-Encoding", "Grpc-Status", "Grpc-Message", "Grpc-Status-Details-Bin"}

func newMux(store idem.Store, orders *shop.Orders) (*http.ServeMux, error) {
	protect, err := idem.New(store, &idem.Config{
		StoredHeaders:   append(slices.Clone(idem.DefaultStoredHeaders), grpcWebHeaders...),
		FingerprintFunc: fingerprint(func() proto.Message { return new(structpb.Struct) }),
	})
	if err != nil {
		return nil, err
	}
	create := connect.NewUnaryHandler(CreateOrderProcedure, method(func(ctx context.Context, req *connect.Request[structpb.Struct]) (*connect.Response[structpb.Struct], error) {
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
	}))
	mux := http.NewServeMux()
	mux.Handle("POST "+CreateOrderProcedure, shop.Auth(keyed(protect, create)))
	mux.Handle("GET /orders", shop.Auth(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string][]shop.Order{"orders": orders.List(idem.ScopeFrom(r.Context()), r.URL.Query().Get("cart_id"))})
	})))
	return mux, nil
}

type (
	ranKey     struct{} // *atomic.Bool: the method ran
	refusedKey struct{} // bool: a gRPC call, refused
	answerKey  struct{} // *buffered: connect's answer when the method did not run
)

// notRun is the panic with which the handler inside idem asks idem to
// release the key: connect answered without running the method.
type notRun struct{}

// method wraps a Connect unary method for keyed: it records that the method
// ran, and refuses gRPC calls.
func method[Req, Res any](f func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error)) func(context.Context, *connect.Request[Req]) (*connect.Response[Res], error) {
	return func(ctx context.Context, req *connect.Request[Req]) (*connect.Response[Res], error) {
		if refused, _ := ctx.Value(refusedKey{}).(bool); refused {
			return nil, connect.NewError(connect.CodeUnimplemented, errors.New("this procedure is idempotent under Idempotency-Key, and a gRPC answer's status travels in HTTP trailers, which are not stored: call it with the Connect or gRPC-Web protocol"))
		}
		if ran, ok := ctx.Value(ranKey{}).(*atomic.Bool); ok {
			ran.Store(true)
		}
		return f(ctx, req)
	}
}

// keyed returns h, a Connect handler whose method is wrapped with method,
// behind protect (the idem middleware), as the package documentation says.
func keyed(protect func(http.Handler) http.Handler, h http.Handler) http.Handler {
	inner := protect(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var ran atomic.Bool
		buf := &buffered{header: make(http.Header)}
		h.ServeHTTP(buf, r.WithContext(context.WithValue(r.Context(), ranKey{}, &ran)))
		if !ran.Load() {
			if out, ok := r.Context().Value(answerKey{}).(*buffered); ok {
				*out = *buf
				panic(notRun{}) // idem releases the key; recovered below
			}
		}
		buf.writeTo(w)
	}))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// connect matches the media type without regard to case (and
		// Application/GRPC is gRPC to it), so the refusal does too.
		ct, _, _ := strings.Cut(r.Header.Get("Content-Type"), ";")
		ct = strings.ToLower(strings.TrimSpace(ct))
		if ct == "application/grpc" || strings.HasPrefix(ct, "application/grpc+") {
			h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), refusedKey{}, true)))
			return
		}
		r.Header.Del("Connect-Timeout-Ms")
		r.Header.Del("Grpc-Timeout")
		out := &buffered{}
		defer func() {
			if v := recover(); v != nil {
				if _, ok := v.(notRun); !ok {
					panic(v)
				}
				out.writeTo(w)
			}
		}()
		inner.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), answerKey{}, out)))
	})
}

// fingerprint returns the idem.FingerprintFunc of a procedure whose request
// messages newReq makes: idem.FingerprintV3 over the codec's name and the
// message's deterministic encoding when the body is a protobuf message, binary
// or JSON (Connect "application/proto" and "application/json", or one
// gRPC-Web frame of "application/grpc-web[+proto|+json]"), uncompressed or
// gzip; over the body as sent otherwise (other encodings, what does not
// decode).
func fingerprint(newReq func() proto.Message) idem.FingerprintFunc {
	return func(r *http.Request, body []byte) string {
		if canon, ok := canonicalProto(r, body, newReq); ok {
			return idem.FingerprintV3(r, canon)
		}
		return idem.FingerprintV3(r, body)
	}
}

// maxCanonicalMessage bounds a compressed message decompressed for its
// fingerprint; a larger one is fingerprinted as sent.
const maxCanonicalMessage = 4 << 20

func canonicalProto(r *http.Request, body []byte, newReq func() proto.Message) ([]byte, bool) {
	mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var msg []byte
	var encoding string
	switch mt {
	case "application/proto":
		msg, encoding = body, r.Header.Get("Content-Encoding")
	case "application/json":
		msg, encoding = body, r.Header.Get("Content-Encoding")
	case "application/grpc-web", "application/grpc-web+proto", "application/grpc-web+json":
		// One frame: flags (bit 0: compressed with Grpc-Encoding), a 4-byte length, the message.
		if len(body) < 5 || body[0]&^1 != 0 || int(binary.BigEndian.Uint32(body[1:5])) != len(body)-5 {
			return nil, false
		}
		msg = body[5:]
		if body[0] == 1 {
			encoding = r.Header.Get("Grpc-Encoding")
		}
	default:
		return nil, false
	}
	switch encoding {
	case "", "identity":
	case "gzip":
		zr, err := gzip.NewReader(bytes.NewReader(msg))
		if err != nil {
			return nil, false
		}
		msg, err = io.ReadAll(io.LimitReader(zr, maxCanonicalMessage+1))
		if err != nil || len(msg) > maxCanonicalMessage {
			return nil, false
		}
	default:
		return nil, false
	}
	m := newReq()
	unmarshal := proto.Unmarshal
	if strings.HasSuffix(mt, "json") {
		unmarshal = protojson.Unmarshal
	}
	if err := unmarshal(msg, m); err != nil {
		return nil, false
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	if err != nil {
		return nil, false
	}
	// The codec's name first: a canonical message never equals a body fingerprinted as sent.
	return append([]byte("canonical "+mt+"\n"), b...), true
}

// buffered is a unary answer held until it is known whether the method ran.
type buffered struct {
	header http.Header
	status int
	body   []byte
}

func (b *buffered) Header() http.Header { return b.header }

func (b *buffered) WriteHeader(status int) {
	if b.status == 0 {
		b.status = status
	}
}

func (b *buffered) Write(p []byte) (int, error) {
	if b.status == 0 {
		b.status = http.StatusOK
	}
	b.body = append(b.body, p...)
	return len(p), nil
}

// Flush implements http.Flusher: the answer is written whole, at the end.
func (b *buffered) Flush() {}

func (b *buffered) writeTo(w http.ResponseWriter) {
	for k, v := range b.header {
		w.Header()[k] = v
	}
	if b.status == 0 {
		b.status = http.StatusOK
	}
	w.WriteHeader(b.status)
	_, _ = w.Write(b.body)
}

func main() {
	mux, err := newMux(memstore.New(nil), &shop.Orders{Delay: 100 * time.Millisecond})
	if err != nil {
		log.Fatal(err)
	}
	log.Println("Connect example: listening on http://127.0.0.1:8080" + CreateOrderProcedure)
	log.Fatal(http.ListenAndServe("127.0.0.1:8080", mux))
}
