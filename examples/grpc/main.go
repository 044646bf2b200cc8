// Command grpc is the README's gRPC example: a unary Create method made
// idempotent by idemgrpc on SQLite, the order inserted in the transaction idem
// opened so that it and the stored outcome commit together, and a client that
// keys its calls. Run the server, then call it twice with one key: the second
// answer is the replay, and there is one order.
//
//	go run ./examples/grpc -addr 127.0.0.1:50051 &
//	go run ./examples/grpc -call -addr 127.0.0.1:50051 -key order-42 c_42   # ord_1 replayed: false
//	go run ./examples/grpc -call -addr 127.0.0.1:50051 -key order-42 c_42   # ord_1 replayed: true
//
// The service is declared by hand (google.protobuf.Struct messages, no
// generated code) so that the example needs no protoc; a generated service
// registers and calls the same way.
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"time"

	"github.com/google/uuid"
	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"
)

// createMethod is the full name of the keyed method.
const createMethod = "/orders.Orders/Create"

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "listen address (with -call: the server's address)")
	path := flag.String("db", "grpc.db", "SQLite file for the orders and the key records (created if missing)")
	call := flag.Bool("call", false, "be the client: create the order for the cart given as the argument, and print the answer")
	key := flag.String("key", "", "with -call: the idempotency key (empty: a new one); call twice with one key to see the replay")
	tenant := flag.String("tenant", "t1", "with -call: the tenant, sent as the \"tenant\" metadata entry")
	flag.Parse()
	if *call {
		if flag.NArg() != 1 {
			log.Fatal("-call needs the cart ID as its argument, for example: -call -key order-42 c_42")
		}
		if err := callCreate(context.Background(), os.Stdout, *addr, *tenant, *key, flag.Arg(0)); err != nil {
			log.Fatal(err)
		}
		return
	}
	db, err := embedded.Open(*path)
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	srv, err := newServer(context.Background(), db)
	if err != nil {
		log.Fatal(err)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("listening on grpc://%s", ln.Addr())
	log.Fatal(srv.Serve(ln))
}

// janitorEvery is how often the janitor deletes expired key records.
var janitorEvery = time.Minute

// newServer returns the gRPC server: authentication, then idem, in front of
// the orders service, whose orders live in db beside idem's records.
func newServer(ctx context.Context, db *sql.DB) (*grpc.Server, error) {
	if _, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS orders (id INTEGER PRIMARY KEY, cart_id TEXT NOT NULL)`); err != nil {
		return nil, err
	}
	store, err := sqlitestore.New(db, nil)
	if err != nil {
		return nil, err
	}
	if err := store.Migrate(ctx); err != nil { // creates idem_records; safe to run again
		return nil, err
	}
	keys, err := idemgrpc.NewServer(store, nil)
	if err != nil {
		return nil, err
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(auth, keys.UnaryInterceptor()))
	srv.RegisterService(&ordersDesc, createFunc(func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		tx := sqlitestore.Tx(ctx) // the call's transaction: do not commit it
		res, err := tx.ExecContext(ctx, `INSERT INTO orders (cart_id) VALUES (?)`, in.GetFields()["cart_id"].GetStringValue())
		if err != nil {
			return nil, err
		}
		id, _ := res.LastInsertId()
		return structpb.NewStruct(map[string]any{"id": fmt.Sprintf("ord_%d", id)}) // sent after the commit
	}))
	janitor := &idem.Janitor{Store: store, Interval: janitorEvery, OnSweep: func(_ int, err error) {
		if err != nil {
			log.Printf("janitor: %v", err)
		}
	}}
	go func() { _ = janitor.Run(ctx) }()
	return srv, nil
}

// auth stands for the interceptor that authenticates the caller: it puts the
// tenant into the context with idem.WithScope, in front of idem. A real one
// verifies a token; this one trusts the "tenant" metadata entry.
func auth(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get("tenant")) == 1 {
		ctx = idem.WithScope(ctx, md.Get("tenant")[0])
	}
	return handler(ctx, req)
}

// callCreate is the client: it calls Create for cart with key (a new one when
// empty) and prints the order's ID and whether the answer was a replay.
func callCreate(ctx context.Context, w io.Writer, addr, tenant, key, cart string) error {
	conn, err := grpc.NewClient(addr,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(idemgrpc.UnaryClientInterceptor(nil))) // a key per call, the same on every retry of it
	if err != nil {
		return err
	}
	defer conn.Close()
	if key == "" {
		key = uuid.NewString()
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "tenant", tenant)
	ctx = idemgrpc.WithKey(ctx, key) // the key of an operation the caller retries itself
	in, err := structpb.NewStruct(map[string]any{"cart_id": cart})
	if err != nil {
		return err
	}
	var header metadata.MD
	out := new(structpb.Struct)
	if err := conn.Invoke(ctx, createMethod, in, out, grpc.Header(&header), grpc.WaitForReady(true)); err != nil {
		return fmt.Errorf("create the order for %s with key %s at %s: %w", cart, key, addr, err)
	}
	_, err = fmt.Fprintln(w, out.GetFields()["id"].GetStringValue(), "replayed:", idemgrpc.Replayed(header))
	return err
}

// createFunc is the orders service: its Create method.
type createFunc func(context.Context, *structpb.Struct) (*structpb.Struct, error)

// ordersDesc declares the service orders.Orders with one unary method, Create,
// as generated code would.
var ordersDesc = grpc.ServiceDesc{
	ServiceName: "orders.Orders",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Create",
		Handler: func(srv any, ctx context.Context, dec func(any) error, interceptor grpc.UnaryServerInterceptor) (any, error) {
			in := new(structpb.Struct)
			if err := dec(in); err != nil {
				return nil, err
			}
			create := srv.(createFunc)
			if interceptor == nil {
				return create(ctx, in)
			}
			return interceptor(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: createMethod}, func(ctx context.Context, req any) (any, error) {
				return create(ctx, req.(*structpb.Struct))
			})
		},
	}},
	Metadata: "orders.proto",
}
