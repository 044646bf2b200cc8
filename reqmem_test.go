package idem

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// The default fingerprint, computed into the request's own memory, is
// FingerprintV3's, for bodies kept in the request's memory and larger ones.
func TestDefaultFingerprintIsV3(t *testing.T) {
	for _, size := range []int{0, 1, smallBody, smallBody + 1, 5000} {
		body := strings.Repeat("b", size)
		var stored []string
		store := &claimRecorder{claimed: &stored}
		mw, err := New(store, nil)
		if err != nil {
			t.Fatal(err)
		}
		var seen string
		h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			b, _ := io.ReadAll(r.Body)
			seen = string(b)
		}))
		r := httptest.NewRequest(http.MethodPost, "/orders/a%2Fb?x=1", strings.NewReader(body))
		r.Header.Set("Idempotency-Key", "k")
		h.ServeHTTP(httptest.NewRecorder(), r)
		want := FingerprintV3(httptest.NewRequest(http.MethodPost, "/orders/a%2Fb?x=1", nil), []byte(body))
		if len(stored) != 1 || stored[0] != want {
			t.Errorf("body of %d bytes: claimed with %q, want %q", size, stored, want)
		}
		if seen != body {
			t.Errorf("body of %d bytes: the handler read %d bytes, want all of it", size, len(seen))
		}
	}
}

// claimRecorder is a nopStore that notes the fingerprint of every claim and
// grants it.
type claimRecorder struct {
	nopStore
	claimed *[]string
}

func (s *claimRecorder) Claim(_ context.Context, c ClaimRequest) (*Record, bool, error) {
	*s.claimed = append(*s.claimed, c.Fingerprint)
	return &Record{Scope: c.Scope, Key: c.Key, State: StateInFlight, Fingerprint: c.Fingerprint, Token: c.Token, CreatedAt: c.Now, LeaseUntil: c.LeaseUntil, ExpiresAt: c.ExpiresAt}, true, nil
}
