package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
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
