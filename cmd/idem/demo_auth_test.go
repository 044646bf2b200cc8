package main

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

// TestDemoTwoAuthorizationLines: a request with two Authorization lines (one
// a proxy appended, one the client sent) is 401 and makes nothing: the demo
// took the first as the tenant, so whoever sent it chose whose order it was.
// The key stays free for a request with one line.
func TestDemoTwoAuthorizationLines(t *testing.T) {
	t.Parallel()
	d := startDemo(t, t.TempDir(), nil)
	key, body := "auth2-"+cliRandHex(6), `{"cart_id":"c_auth2","total_cents":1}`
	for _, order := range [][2]string{{"t1", "t2"}, {"t2", "t1"}} {
		req, err := http.NewRequest("POST", d.URL+"/orders", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Add("Authorization", "Bearer "+order[0])
		req.Header.Add("Authorization", "Bearer "+order[1])
		req.Header.Set("Idempotency-Key", key)
		resp, err := (&http.Client{Transport: &http.Transport{DisableKeepAlives: true}}).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 401 || !strings.Contains(string(data), `"code":"unauthorized"`) {
			t.Fatalf("two Authorization lines (%s, %s): %d %s, want 401 unauthorized", order[0], order[1], resp.StatusCode, data)
		}
	}
	for _, tenant := range []string{"t1", "t2"} {
		if l := listOrders(t, d.URL, tenant, "c_auth2"); len(l) != 0 {
			t.Fatalf("tenant %s has %d orders after the refused requests, want 0", tenant, len(l))
		}
	}
	if a := sendHTTP(t, "POST", d.URL+"/orders", "t2", key, body); a.Status != 201 || a.replayed() {
		t.Fatalf("the key with one Authorization line: %d replayed=%v %s, want an executed 201", a.Status, a.replayed(), a.Body)
	}
}
