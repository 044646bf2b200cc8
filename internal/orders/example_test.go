package orders_test

import (
	"context"
	"database/sql"
	"fmt"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/memstore"
)

// The service behind Authenticate and the idem middleware: the retry of a POST
// is answered with the stored outcome, and there is still one order.
func Example() {
	dir, _ := os.MkdirTemp("", "orders-example")
	defer os.RemoveAll(dir)
	db, _ := sql.Open("sqlite", "file:"+filepath.Join(dir, "shop.db"))
	defer db.Close()

	backend, _ := orders.SQL(db, orders.SQLite, nil) // nil: the handler commits its own transaction
	svc, _ := orders.New(backend, nil)
	if err := svc.Migrate(context.Background()); err != nil {
		fmt.Println(err)
		return
	}
	store := memstore.New(nil)
	defer store.Close()
	mw, _ := idem.New(store, nil)
	h := orders.Authenticate(svc.Handler(mw))

	for range 2 {
		req := httptest.NewRequest("POST", "/orders", strings.NewReader(`{"cart_id":"c_42","total_cents":1900}`))
		req.Header.Set("Authorization", "Bearer t1")
		req.Header.Set("Idempotency-Key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		fmt.Println(rec.Code, "replayed:", rec.Header().Get(idem.ReplayedHeader) == "true")
	}
	list, _ := svc.Orders(context.Background(), "t1", "c_42")
	fmt.Println("orders for c_42:", len(list))

	req := httptest.NewRequest("POST", "/orders", strings.NewReader(`{"cart_id":"c_42","total_cents":1900}`))
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	fmt.Println("without Authorization:", rec.Code)
	// Output:
	// 201 replayed: false
	// 201 replayed: true
	// orders for c_42: 1
	// without Authorization: 401
}
