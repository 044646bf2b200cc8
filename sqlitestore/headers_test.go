package sqlitestore

import (
	"encoding/json"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// The headers column written by hand decodes to the headers stored, and to what
// json.Marshal's column (written before) decodes to; headers with a value or a
// name that is not UTF-8 keep the base64 form.
func TestEncodeHeaders(t *testing.T) {
	t.Parallel()
	for _, h := range []http.Header{
		{"Content-Type": {"application/json"}, "Location": {"/orders/12"}},
		{"X-Quote": {`a "quoted" \ value`, "tab\there", "nl\nand\rcr", "ctl\x00\x01\x1f\x7f", "<&>", "é ✓ \u2028"}},
		{"X-Empty": {}, "X-Nil": nil, "X-Blank": {""}},
		{`Odd "name" \`: {"v"}},
		{"X-Bin": {"\xff\xfe"}, "X-Text": {"ok"}},
		{"\xffname": {"v"}},
	} {
		col, err := encodeHeaders(h)
		if err != nil {
			t.Fatal(err)
		}
		got, err := decodeHeaders(col)
		if err != nil {
			t.Fatalf("%q: %v", col, err)
		}
		want := h
		if !strings.HasPrefix(col, binaryHeaders) {
			// What the column written by json.Marshal decodes to.
			b, err := json.Marshal(h)
			if err != nil {
				t.Fatal(err)
			}
			if want, err = decodeHeaders(string(b)); err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(h, want) {
				t.Fatalf("test case %v does not survive json.Marshal: %v", h, want)
			}
		} else if _, ok := h["\xffname"]; ok {
			want = http.Header{"\ufffdname": {"v"}} // json.Marshal replaces the byte, as it always did
		}
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%q decodes to %#v, want %#v", col, got, want)
		}
	}
}
