// Package shop is the business logic the router examples serve: an in-memory
// order book per tenant, the bearer-token check that names the tenant, and
// net/http handlers for the routers that take them (chi, gorilla/mux). It knows
// nothing of routers.
package shop

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

// Order is a placed order.
type Order struct {
	ID         string `json:"id"`
	CartID     string `json:"cart_id"`
	TotalCents int64  `json:"total_cents"`
}

// NewOrder is the body of POST /orders.
type NewOrder struct {
	CartID     string `json:"cart_id"`
	TotalCents int64  `json:"total_cents"`
}

// Orders is an in-memory order book, one list per tenant.
type Orders struct {
	// Delay is how long placing an order takes (a slow payment call), so that
	// retries and races overlap the first execution.
	Delay time.Duration

	mu       sync.Mutex
	n        int
	byTenant map[string][]Order
}

// ErrInvalid is returned by Create for an order without a cart or total.
var ErrInvalid = errors.New("an order needs a cart_id and a positive total_cents")

// Create places an order for tenant.
func (o *Orders) Create(tenant string, in NewOrder) (Order, error) {
	if in.CartID == "" || in.TotalCents <= 0 {
		return Order{}, ErrInvalid
	}
	time.Sleep(o.Delay)
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.byTenant == nil {
		o.byTenant = make(map[string][]Order)
	}
	o.n++
	ord := Order{ID: fmt.Sprintf("ord_%d", o.n), CartID: in.CartID, TotalCents: in.TotalCents}
	o.byTenant[tenant] = append(o.byTenant[tenant], ord)
	return ord, nil
}

// List returns tenant's orders for cart (all of them when cart is empty).
func (o *Orders) List(tenant, cart string) []Order {
	o.mu.Lock()
	defer o.mu.Unlock()
	out := []Order{}
	for _, ord := range o.byTenant[tenant] {
		if cart == "" || ord.CartID == cart {
			out = append(out, ord)
		}
	}
	return out
}

// Tenant returns the tenant named by the request's "Authorization: Bearer
// <tenant>" header (the token is the tenant: a stand-in for verifying a real
// token), and whether there is exactly one. Two Authorization lines name no
// tenant: taking one of them would let whoever added the other choose it.
func Tenant(h http.Header) (string, bool) {
	lines := h.Values("Authorization")
	if len(lines) != 1 {
		return "", false
	}
	tok, ok := strings.CutPrefix(lines[0], "Bearer ")
	if !ok || tok == "" {
		return "", false
	}
	return tok, true
}

// CreateHandler is POST /orders for net/http routers: it places the order for
// the tenant that the authentication middleware put in the context with
// idem.WithScope, and answers 201 with the order (400 for a bad body).
func CreateHandler(o *Orders) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		var in NewOrder
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, "the body is not an order: "+err.Error(), http.StatusBadRequest)
			return
		}
		ord, err := o.Create(idem.ScopeFrom(r.Context()), in)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/"+ord.ID)
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(ord)
	}
}

// ListHandler is GET /orders?cart_id=… for net/http routers: {"orders":[…]}.
func ListHandler(o *Orders) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(map[string][]Order{"orders": o.List(idem.ScopeFrom(r.Context()), r.URL.Query().Get("cart_id"))})
	}
}

// Auth is the authentication middleware for net/http routers: the bearer token
// names the tenant, stored with idem.WithScope for idem and the handlers;
// without one the answer is 401.
func Auth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, ok := Tenant(r.Header)
		if !ok {
			http.Error(w, "send Authorization: Bearer <tenant>", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(idem.WithScope(r.Context(), tenant)))
	})
}
