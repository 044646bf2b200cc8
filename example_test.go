package idem_test

import (
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// A minimal server: POST /orders executes once per Idempotency-Key, and every
// retry gets the stored answer.
func Example() {
	store := memstore.New(nil)
	defer store.Close()
	protect, err := idem.New(store, nil) // nil: all defaults
	if err != nil {
		log.Fatal(err)
	}
	created := 0
	orders := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		created++
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"id":%d}`, created)
	})
	srv := httptest.NewServer(protect(orders))
	defer srv.Close()

	for range 2 { // the same operation, sent twice
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{"cart_id":"c_42"}`))
		req.Header.Set("Idempotency-Key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, string(body), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	fmt.Println("orders created:", created)
	// Output:
	// 201 {"id":1} replayed: false
	// 201 {"id":1} replayed: true
	// orders created: 1
}

// A multi-tenant server: authentication sits in front of idem and puts the
// tenant into the request context with WithScope, so two tenants never share a
// key. Requests it rejects (401) are never bound to a key.
func Example_scoped() {
	store := memstore.New(nil)
	defer store.Close()
	protect, err := idem.New(store, &idem.Config{Methods: []string{"POST"}})
	if err != nil {
		log.Fatal(err)
	}
	created := 0
	orders := protect(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		created++
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, "order %d for %s", created, idem.ScopeFrom(r.Context()))
	}))
	auth := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tenant, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			if !ok || tenant == "" {
				http.Error(w, "unauthorized", http.StatusUnauthorized)
				return
			}
			next.ServeHTTP(w, r.WithContext(idem.WithScope(r.Context(), tenant)))
		})
	}
	srv := httptest.NewServer(auth(orders))
	defer srv.Close()

	for _, tenant := range []string{"", "acme", "acme", "globex"} {
		req, _ := http.NewRequest("POST", srv.URL, strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "same-key")
		if tenant != "" {
			req.Header.Set("Authorization", "Bearer "+tenant)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Printf("%-7q %d %s\n", tenant, resp.StatusCode, strings.TrimSpace(string(body)))
	}
	// Output:
	// ""      401 unauthorized
	// "acme"  201 order 1 for acme
	// "acme"  201 order 1 for acme
	// "globex" 201 order 2 for globex
}
