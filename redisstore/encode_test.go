package redisstore

import (
	"net/http"
	"reflect"
	"testing"
)

func TestHeaderEncoding(t *testing.T) {
	t.Parallel()
	for _, h := range []http.Header{
		nil,
		{"A": {""}},
		{"Content-Type": {"text/plain"}, "Link": {"<a>", "<b>", ""}, "X-Bin": {"\xff\x00\xfe"}},
		{"": {"empty name"}, "No-Values": {}},
	} {
		got, err := decodeHeader(string(encodeHeader(h)))
		if err != nil {
			t.Fatalf("decode(encode(%q)): %v", h, err)
		}
		if len(h) == 0 {
			if got != nil {
				t.Errorf("empty header decoded as %q, want nil", got)
			}
			continue
		}
		if !reflect.DeepEqual(got, h) {
			t.Errorf("decode(encode(%q)) = %q", h, got)
		}
	}
	for _, bad := range []string{"\x01", "\x01\x01a", "\x01\x01a\x02\x01b", "\x01\x00\x00extra", "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", "\x05garbage"} {
		if h, err := decodeHeader(bad); err == nil {
			t.Errorf("decodeHeader(%q) = %q, nil; want an error", bad, h)
		}
	}
}

func FuzzDecodeHeader(f *testing.F) {
	f.Add(string(encodeHeader(http.Header{"Content-Type": {"a", "b"}})))
	f.Add("\x01\x01a\x01\x01b")
	f.Fuzz(func(t *testing.T, s string) {
		h, err := decodeHeader(s)
		if err != nil {
			return
		}
		// Whatever decodes must encode back to something that decodes the same.
		again, err := decodeHeader(string(encodeHeader(h)))
		if err != nil || (len(h) > 0 && !reflect.DeepEqual(again, h)) {
			t.Fatalf("round trip of %q: %q, %v", h, again, err)
		}
	})
}

func TestRecordKey(t *testing.T) {
	t.Parallel()
	s := &Store{prefix: "p:"}
	if got, want := s.recordKey("a}", "{b"), "p:{YX0.e2I}"; got != want {
		t.Errorf("recordKey = %q, want %q", got, want)
	}
	seen := map[string][2]string{}
	for _, p := range [][2]string{{"", "ab"}, {"a", "b"}, {"ab", ""}, {"a.", "b"}, {"a", ".b"}, {"", ""}} {
		k := s.recordKey(p[0], p[1])
		if q, dup := seen[k]; dup {
			t.Errorf("(%q, %q) and (%q, %q) share the key %q", p[0], p[1], q[0], q[1], k)
		}
		seen[k] = p
	}
}
