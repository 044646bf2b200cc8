package idemotel_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemotel"
	"github.com/idemkit/idem/memstore"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// quotingStore fails every claim naming the key as pgstore and redisstore
// do: Go-quoted, and cut to its first 64 bytes when longer.
type quotingStore struct{ idem.Store }

func (quotingStore) Claim(_ context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	short := fmt.Sprintf("%q", req.Key)
	if len(req.Key) > 64 {
		short = fmt.Sprintf("%q… (%d bytes)", req.Key[:64], len(req.Key))
	}
	return nil, false, fmt.Errorf("store: record for key %s is malformed", short)
}

// TestRecordedErrorsHideQuotedKeys: the error recorded on a store_error span
// must not carry the key in the forms stores write it (a key with '"' and
// '\', a 255-byte key cut short).
func TestRecordedErrorsHideQuotedKeys(t *testing.T) {
	t.Parallel()
	spans := tracetest.NewSpanRecorder()
	tel, err := idemotel.New(&idemotel.Config{TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans))})
	if err != nil {
		t.Fatal(err)
	}
	mem := memstore.New(nil)
	t.Cleanup(func() { _ = mem.Close() })
	mw, err := idem.New(quotingStore{mem}, &idem.Config{Observer: tel, MaxKeyLength: 255})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(201) })))
	t.Cleanup(srv.Close)
	for _, header := range []string{`"k-SECRETQUOTE\"x\\y"`, "k-SECRETLONG" + strings.Repeat("z", 243)} {
		req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", header)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 503 {
			t.Fatalf("status %d, want 503", resp.StatusCode)
		}
	}
	recorded := 0
	for _, sp := range spans.Ended() {
		for _, ev := range sp.Events() {
			for _, kv := range ev.Attributes {
				v := kv.Value.String()
				recorded++
				if strings.Contains(v, "SECRET") {
					t.Errorf("span %s event %s: %s=%q carries the key", sp.Name(), ev.Name, kv.Key, v)
				}
			}
		}
	}
	if recorded == 0 {
		t.Fatal("no error recorded on any span")
	}
}
