package idem_test

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// TestLateWriteReachesNoLaterResponse: the body of a first-time request is
// buffered in pooled storage (the store copies what it keeps). A handler that
// keeps its ResponseWriter and writes to it after it returned — a misuse that
// net/http does not stop — must reach no later request's answer, neither the
// one sent nor the one stored and replayed.
func TestLateWriteReachesNoLaterResponse(t *testing.T) {
	t.Parallel()
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	var kept http.ResponseWriter
	long := strings.Repeat("b", 200)
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/short" {
			kept = w
			_, _ = w.Write([]byte("a"))
			return
		}
		_, _ = w.Write([]byte(long))
		_, _ = kept.Write([]byte("XXXXXXXX")) // the earlier request's writer, long after it returned
	}))
	send := func(path, key string) *httptest.ResponseRecorder {
		r := httptest.NewRequest(http.MethodPost, path, strings.NewReader("{}"))
		r.Header.Set("Idempotency-Key", key)
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w
	}
	for i := range 50 {
		k := strconv.Itoa(i)
		if w := send("/short", "short-"+k); w.Body.String() != "a" {
			t.Fatalf("round %d: short answer %q", i, w.Body.String())
		}
		if w := send("/long", "long-"+k); w.Body.String() != long {
			t.Fatalf("round %d: the later answer was written into: %q", i, w.Body.String())
		}
		if w := send("/long", "long-"+k); !bytes.Equal(w.Body.Bytes(), []byte(long)) || w.Header().Get(idem.ReplayedHeader) != "true" {
			t.Fatalf("round %d: the stored answer was written into: %q", i, w.Body.String())
		}
	}
}
