package idem_test

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

func TestFingerprintV1(t *testing.T) {
	t.Parallel()
	fp := func(method, target, body string) string {
		return idem.FingerprintV1(httptest.NewRequest(method, target, nil), []byte(body))
	}
	base := fp("POST", "/orders", `{"a":1}`)
	if !strings.HasPrefix(base, "v1:") || len(base) != 3+64 {
		t.Fatalf("fingerprint %q: want v1: and 64 hex digits", base)
	}
	if again := fp("POST", "/orders", `{"a":1}`); again != base {
		t.Errorf("same request fingerprinted twice: %q then %q", base, again)
	}
	if q := fp("POST", "/orders?x=1", `{"a":1}`); q != base {
		t.Errorf("the query string changed the fingerprint; v1 covers method, path and body only")
	}
	differ := map[string]string{
		"method": fp("PATCH", "/orders", `{"a":1}`),
		"path":   fp("POST", "/orders/", `{"a":1}`),
		"body":   fp("POST", "/orders", `{"a":2}`),
		"shift":  fp("POST", "/order", `s{"a":1}`), // field boundaries are length-prefixed
	}
	for what, other := range differ {
		if other == base {
			t.Errorf("changing the %s kept the fingerprint", what)
		}
	}
}

func FuzzFingerprint(f *testing.F) {
	f.Add("POST", "/orders", []byte(`{"cart_id":"c_42"}`), []byte(`{"cart_id":"c_43"}`))
	f.Add("PATCH", "/a/b", []byte{}, []byte{0})
	f.Fuzz(func(t *testing.T, method, path string, body1, body2 []byte) {
		if method == "" || strings.ContainsAny(method, " \t\r\n/") || !strings.HasPrefix(path, "/") || strings.ContainsAny(path, " \t\r\n?#%") {
			t.Skip()
		}
		r := httptest.NewRequest("POST", "/", nil)
		r.Method = method
		r.URL.Path = path
		a, b := idem.FingerprintV1(r, body1), idem.FingerprintV1(r, body1)
		if a != b {
			t.Fatalf("not deterministic: %q vs %q", a, b)
		}
		if len(a) != 67 || !strings.HasPrefix(a, "v1:") {
			t.Fatalf("malformed fingerprint %q", a)
		}
		if c := idem.FingerprintV1(r, body2); (c == a) != (string(body1) == string(body2)) {
			t.Fatalf("bodies %q and %q: fingerprints %q and %q", body1, body2, a, c)
		}
	})
}

func TestFingerprintV2EscapedPath(t *testing.T) {
	t.Parallel()
	fp := func(f idem.FingerprintFunc, target string) string {
		return f(httptest.NewRequest("POST", target, nil), []byte("{}"))
	}
	encoded, decoded := fp(idem.FingerprintV2, "/files/a%2Fb"), fp(idem.FingerprintV2, "/files/a/b")
	if !strings.HasPrefix(encoded, "v2:") || len(encoded) != 3+64 {
		t.Fatalf("fingerprint %q: want v2: and 64 hex digits", encoded)
	}
	if encoded == decoded {
		t.Error("v2: /files/a%2Fb and /files/a/b share a fingerprint; ServeMux routes them apart")
	}
	// v1 kept its algorithm, so records stored under it still match.
	if fp(idem.FingerprintV1, "/files/a%2Fb") != fp(idem.FingerprintV1, "/files/a/b") {
		t.Error("v1 changed: it fingerprints the decoded path")
	}
	// Computed by the first release's FingerprintV1.
	const v1Orders = "v1:7756cef74c3f61dc03eaca49f27dff490bb6ac85c8866ef8c8f05c4219a9f21a"
	if got := fp(idem.FingerprintV1, "/orders"); got != v1Orders {
		t.Errorf("FingerprintV1(POST /orders {}) = %s, want the first release's %s", got, v1Orders)
	}
}
