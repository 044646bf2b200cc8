package clienttest_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"

	"github.com/idemkit/idem/client/clienttest"
)

func ExampleProxy() {
	var orders atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		orders.Add(1)
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	// Every connection loses its answer: the server creates the order, the client
	// sees its connection reset.
	p, err := clienttest.NewProxy(strings.TrimPrefix(srv.URL, "http://"), 1, 1)
	if err != nil {
		panic(err)
	}
	defer p.Close()
	c := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}}
	_, err = c.Post(p.URL()+"/orders", "application/json", strings.NewReader(`{}`))
	st := p.Stats()
	fmt.Printf("client error: %v; answers dropped: %d of %d; orders created: %d\n", err != nil, st.Dropped, st.Answered, orders.Load())
	// Output: client error: true; answers dropped: 1 of 1; orders created: 1
}
