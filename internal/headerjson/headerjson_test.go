package headerjson

import (
	"encoding/json"
	"math/rand/v2"
	"reflect"
	"testing"
	"unicode/utf8"
)

// What DecodePlain accepts, it decodes as encoding/json does; what it refuses
// is left to encoding/json.
func TestDecodePlainAgreesWithEncodingJSON(t *testing.T) {
	for _, in := range []string{
		`{}`, ` { } `, `{"A":[]}`, `{"A":["1","2"],"B":["3"]}`, `{"A": ["1"] , "B" : [ "2" ]}`,
		`{"A":["1"],"A":["2"]}`, `{"Location":["/caf` + "\u00e9" + `"]}`,
		`{"A":["\n"]}`, `{"A":["\u0041"]}`, `{"A":null}`, `{"A":[1]}`, `{"A":["1"]`, `{"A":["1"]}x`,
		`{"A":["` + "\xff" + `"]}`, `[]`, ``, `{"A":{"b64":"AA=="}}`, `{"A":["1",]}`, `{,}`,
	} {
		got, ok := DecodePlain([]byte(in))
		var want map[string][]string
		err := json.Unmarshal([]byte(in), &want)
		if !ok {
			continue
		}
		if err != nil {
			t.Errorf("%q: DecodePlain accepted what encoding/json refuses (%v)", in, err)
			continue
		}
		if !reflect.DeepEqual(map[string][]string(got), want) {
			t.Errorf("%q: DecodePlain = %v, encoding/json = %v", in, got, want)
		}
	}
	if _, ok := DecodePlain([]byte(`{"A":["1"]}`)); !ok {
		t.Error("the usual headers were not decoded")
	}
}

// AppendString writes what encoding/json reads back as the same string, for
// any valid UTF-8, and what DecodePlain reads back when no escape was needed.
func TestAppendStringRoundTrips(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	alphabet := []rune{'a', 'Z', '0', ' ', '"', '\\', '\n', '\r', '\t', 0, 1, 0x1f, 0x7f, '<', '&', 'é', '€', '𝄞', '\u2028'}
	for range 2000 {
		rs := make([]rune, rng.IntN(12))
		for i := range rs {
			rs[i] = alphabet[rng.IntN(len(alphabet))]
		}
		s := string(rs)
		enc := AppendString(nil, s)
		var back string
		if err := json.Unmarshal(enc, &back); err != nil || back != s {
			t.Fatalf("%q: wrote %s, read back %q (%v)", s, enc, back, err)
		}
		obj := append(append([]byte(`{"H":[`), enc...), ']', '}')
		if h, ok := DecodePlain(obj); ok && (len(h["H"]) != 1 || h["H"][0] != s) {
			t.Fatalf("%q: DecodePlain read %v", s, h)
		}
		if !utf8.ValidString(s) {
			t.Fatalf("test bug: %q", s)
		}
	}
	if got := string(AppendString(nil, "a\"b\\c\x01")); got != `"a\"b\\c\u0001"` {
		t.Errorf("escapes: %s", got)
	}
}

// AppendHeaders writes what encoding/json reads back as the same headers (a
// nil value as null, as encoding/json writes it), after what dst held.
func TestAppendHeadersRoundTrips(t *testing.T) {
	for _, h := range []map[string][]string{
		{}, {"Location": {"/orders/1"}}, {"Link": {"a", "b\n\"c\""}, "Content-Type": {"application/json"}},
		{"X": nil}, {"X": {}}, {"Caf\u00e9": {"\u20ac", "\x01"}},
	} {
		out := AppendHeaders([]byte("prefix"), h)
		if string(out[:6]) != "prefix" {
			t.Fatalf("%v: the prefix was overwritten: %s", h, out)
		}
		var back map[string][]string
		if err := json.Unmarshal(out[6:], &back); err != nil || !reflect.DeepEqual(back, h) {
			t.Errorf("%v: wrote %s, read back %#v (%v)", h, out[6:], back, err)
		}
	}
}
