package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem/examples/internal/exampletest"
)

// The quick start answers a retry with the stored answer.
func TestQuickstart(t *testing.T) {
	srv := httptest.NewServer(newServer())
	defer srv.Close()
	var bodies []string
	for range 2 {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/orders", strings.NewReader(`{"cart_id":"c_42","total_cents":1900}`))
		req.Header.Set("Idempotency-Key", "8e03978e-40d5-43e8-bc93-6894a57f9324")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusCreated {
			t.Fatalf("%d %s", resp.StatusCode, b)
		}
		bodies = append(bodies, string(b))
	}
	if bodies[0] != `{"id":1}` || bodies[1] != bodies[0] || orderIDs.Load() != 1 {
		t.Fatalf("answers %q, %d orders; want one order, replayed", bodies, orderIDs.Load())
	}
}

// The command honours -addr, as the README says the examples do: it listened
// on 127.0.0.1:8080 whatever it was given.
func TestQuickstartAddrFlag(t *testing.T) {
	url := exampletest.RunMain(t, "-addr", "127.0.0.1:0")
	if strings.HasSuffix(url, ":8080") {
		t.Fatalf("asked for a free port, listening on %s", url)
	}
	if status, _, body := exampletest.Post(t, url+"/orders", "qs-addr-1"); status != http.StatusCreated {
		t.Fatalf("POST %s/orders: %d %s", url, status, body)
	}
}
