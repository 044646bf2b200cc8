package client_test

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/idemkit/idem/client"
)

// okTransport answers every request with 201 without a network, so the benchmark
// measures what the Transport adds per operation: key, request copy, body rewind.
type okTransport struct{}

func (okTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		_, _ = io.Copy(io.Discard, r.Body)
		_ = r.Body.Close()
	}
	return &http.Response{StatusCode: 201, Header: http.Header{}, Body: http.NoBody, Request: r}, nil
}

func BenchmarkRoundTrip(b *testing.B) {
	const body = `{"cart_id":"cart-00001","items":[{"sku":"A-1","qty":2}]}`
	run := func(b *testing.B, rt http.RoundTripper, hideGetBody bool) {
		b.ReportAllocs()
		for b.Loop() {
			var r io.Reader = strings.NewReader(body)
			if hideGetBody {
				r = hiddenReader{r}
			}
			req, _ := http.NewRequest(http.MethodPost, "http://orders.test/orders", r)
			resp, err := rt.RoundTrip(req)
			if err != nil {
				b.Fatal(err)
			}
			_ = resp.Body.Close()
		}
	}
	b.Run("base", func(b *testing.B) { run(b, okTransport{}, false) })
	b.Run("idem", func(b *testing.B) { run(b, &client.Transport{Base: okTransport{}}, false) })
	b.Run("idem-buffered-body", func(b *testing.B) { run(b, &client.Transport{Base: okTransport{}}, true) })
}
