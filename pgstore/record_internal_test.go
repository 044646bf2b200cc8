package pgstore

import (
	"encoding/base64"
	"encoding/json"
	"math/rand/v2"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/idemkit/idem/internal/headerjson"
)

// marshalHeaders is the encoding encodeHeaders replaced (encoding/json), kept
// as the reference its output must equal as JSON.
func marshalHeaders(h http.Header) []byte {
	m := make(map[string][]any, len(h))
	for name, vs := range h {
		out := make([]any, len(vs))
		for i, v := range vs {
			if utf8.ValidString(v) && !strings.ContainsRune(v, 0) {
				out[i] = v
			} else {
				out[i] = b64Value{B64: base64.StdEncoding.EncodeToString([]byte(v))}
			}
		}
		m[name] = out
	}
	b, _ := json.Marshal(m)
	return b
}

// TestEncodeHeaders: the hand-written encoding is valid JSON, equal as JSON to
// encoding/json's, and decodes back to the same header, for headers with
// quotes, backslashes, control characters, non-ASCII, NUL and invalid UTF-8,
// and for random ones.
func TestEncodeHeaders(t *testing.T) {
	cases := []http.Header{
		{"Content-Type": {"application/json"}, "Location": {"/orders/1"}},
		{"X-Q": {`a "quoted" \ back\slash`, "tab\there\r\nline", "\x01\x1f\x7f", "caf\u00e9 \u2028 \U0001f600", "", "<&>"}},
		{"X-Bin": {"nul\x00byte", "bad\xffutf8"}, "Empty": {}},
		{"Na\"me\\": {"v"}},
	}
	r := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"a", "\"", "\\", "\x00", "\x01", "\n", "\u00e9", "\xff", "\xc3", "/", " ", "\U0001f600", "\u2028"}
	for range 300 {
		h := http.Header{}
		for range r.IntN(4) + 1 {
			var name strings.Builder
			for range r.IntN(6) + 1 {
				name.WriteString(alphabet[r.IntN(len(alphabet))])
			}
			if !utf8.ValidString(name.String()) || strings.ContainsRune(name.String(), 0) {
				continue
			}
			var vs []string
			for range r.IntN(3) {
				var v strings.Builder
				for range r.IntN(8) {
					v.WriteString(alphabet[r.IntN(len(alphabet))])
				}
				vs = append(vs, v.String())
			}
			h[name.String()] = vs
		}
		cases = append(cases, h)
	}
	for _, h := range cases {
		got, err := encodeHeaders(h)
		if err != nil {
			t.Fatalf("encodeHeaders(%q): %v", h, err)
		}
		if len(h) == 0 {
			if got != nil {
				t.Fatalf("encodeHeaders of an empty header = %s, want nil (NULL)", got)
			}
			continue
		}
		if !json.Valid(got) {
			t.Fatalf("encodeHeaders(%q) = %s: not valid JSON", h, got)
		}
		var a, b any
		_ = json.Unmarshal(got, &a)
		_ = json.Unmarshal(marshalHeaders(h), &b)
		if !reflect.DeepEqual(a, b) {
			t.Fatalf("encodeHeaders(%q) = %s; encoding/json says %s", h, got, marshalHeaders(h))
		}
		back, err := decodeHeaders(got)
		if err != nil {
			t.Fatal(err)
		}
		for name, vs := range h {
			if len(back[name]) != len(vs) || strings.Join(back[name], "|") != strings.Join(vs, "|") {
				t.Fatalf("header %q: %q after a round trip, want %q", name, back[name], vs)
			}
		}
	}
	if _, err := encodeHeaders(http.Header{"Bad\xff": {"v"}}); err == nil {
		t.Error("a header name that is not UTF-8 was encoded")
	}
}

func BenchmarkEncodeHeaders(b *testing.B) {
	h := http.Header{"Content-Type": {"application/json"}, "Location": {"/orders/12345"}}
	b.ReportAllocs()
	for b.Loop() {
		_, _ = encodeHeaders(h)
	}
}

// TestDecodeHeadersFast: the fast decoder agrees with encoding/json on every
// input it accepts (what pgstore writes and PostgreSQL's jsonb output of it,
// with its spaces and reordered keys), and declines escapes, b64 values and
// malformed input, which the JSON decoder then handles or refuses.
func TestDecodeHeadersFast(t *testing.T) {
	accepted := []string{
		`{"Content-Type":["application/json"],"Location":["/orders/1"]}`,
		`{"Location": ["/orders/1"], "Content-Type": ["application/json"]}`,
		`{}`, ` { } `, `{"Empty": []}`, `{"A": ["1", "2", ""], "B": [], "C": ["caf` + "\u00e9" + `"]}`,
		"{\n\t\"A\" : [ \"x\" , \"y\" ] \r}",
	}
	for _, in := range accepted {
		fast, ok := headerjson.DecodePlain([]byte(in))
		if !ok {
			t.Errorf("fast decoder declined %q", in)
			continue
		}
		slow, err := decodeHeadersJSON([]byte(in))
		if err != nil {
			t.Fatalf("%q: %v", in, err)
		}
		if len(slow) == 0 && len(fast) == 0 {
			continue
		}
		if !reflect.DeepEqual(fast, slow) {
			t.Errorf("%q: fast %#v, encoding/json %#v", in, fast, slow)
		}
	}
	declined := []string{
		`{"A": ["a\"b"]}`, `{"A\n": ["x"]}`, `{"A": [{"b64": "AAE="}]}`, `{"A": ["x"]`, `{"A": ["x"]} x`,
		`{"A": "x"}`, `["x"]`, `{"A" ["x"]}`, `{"A": ["x",]}`, `{"A": ["x"],}`, `{,}`, `{"A": ["x`, "{\"A\": [\"\x01\"]}", ``,
	}
	for _, in := range declined {
		if h, ok := headerjson.DecodePlain([]byte(in)); ok {
			t.Errorf("fast decoder accepted %q as %#v", in, h)
		}
	}
	// Appending to one header's values must not change another's.
	h, _ := headerjson.DecodePlain([]byte(`{"A": ["1"], "B": ["2"]}`))
	_ = append(h["A"], "x")
	if h.Get("B") != "2" {
		t.Errorf("appending to A changed B: %v", h)
	}
}
