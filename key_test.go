package idem_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/idemkit/idem"
)

func TestParseKey(t *testing.T) {
	t.Parallel()
	long := strings.Repeat("k", 255)
	valid := []struct{ in, want string }{
		{"abc", "abc"},
		{`"abc"`, "abc"},
		{"  abc\t", "abc"},
		{` "abc" `, "abc"},
		{"8e03978e-40d5-43e8-bc93-6894a57f9324", "8e03978e-40d5-43e8-bc93-6894a57f9324"},
		{`"a\"b"`, `a"b`},
		{`"a\\b"`, `a\b`},
		{long, long},
		{`"` + long + `"`, long},
		{"!#$%&'*+-.^_`|~:/", "!#$%&'*+-.^_`|~:/"},
		{`"!~{}:*;,=?"`, "!~{}:*;,=?"},
	}
	for _, tc := range valid {
		got, err := idem.ParseKey(tc.in, idem.DefaultMaxKeyLength)
		if err != nil || got != tc.want {
			t.Errorf("ParseKey(%q) = %q, %v; want %q", tc.in, got, err, tc.want)
		}
	}
	invalid := []string{
		"", "   ", `""`, `"`, `"abc`, `abc"`, `a"bc`, `"ab"c"`, `"abc";p=1`, `"a\b"`, `"a\`,
		"a b", `"a b"`, "ab\x00", "ab\x7f", "k\u00fc", "a, b", long + "k", `"` + long + `k"`,
		// A bare key is a token: no parameters, no lists, no delimiters.
		"abc;p=1", "k1, k2", "k1,k2", `"k1", "k2"`, `a\b`, "!~{}:*", "a=b", "(a)", "a@b", "a?b", "[a]", "<a>",
	}
	for _, in := range invalid {
		if got, err := idem.ParseKey(in, idem.DefaultMaxKeyLength); !errors.Is(err, idem.ErrInvalidKey) {
			t.Errorf("ParseKey(%q) = %q, %v; want ErrInvalidKey", in, got, err)
		}
	}
	if _, err := idem.ParseKey("abcd", 3); !errors.Is(err, idem.ErrInvalidKey) || !strings.Contains(err.Error(), "limit of 3") {
		t.Errorf("ParseKey over a custom limit: %v, want an error naming the limit", err)
	}
}

// quote renders key as an RFC 9651 sf-string.
func quote(key string) string {
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
}

func FuzzParseKey(f *testing.F) {
	for _, s := range []string{"abc", `"abc"`, `"a\"b"`, "", `"`, "a b", `"a\\"`, "\xff", strings.Repeat("x", 300)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		key, err := idem.ParseKey(in, idem.DefaultMaxKeyLength)
		if err != nil {
			if !errors.Is(err, idem.ErrInvalidKey) {
				t.Fatalf("ParseKey(%q) error %v does not wrap ErrInvalidKey", in, err)
			}
			return
		}
		if len(key) == 0 || len(key) > idem.DefaultMaxKeyLength {
			t.Fatalf("ParseKey(%q) = %q: length %d out of 1..255", in, key, len(key))
		}
		for i := 0; i < len(key); i++ {
			if key[i] < 0x21 || key[i] > 0x7e {
				t.Fatalf("ParseKey(%q) = %q: byte 0x%02x is not visible ASCII", in, key, key[i])
			}
		}
		// Both spellings name the same key.
		if again, err := idem.ParseKey(quote(key), idem.DefaultMaxKeyLength); err != nil || again != key {
			t.Fatalf("quoted form %s of %q parsed as %q, %v", quote(key), key, again, err)
		}
		if isToken(key) {
			if again, err := idem.ParseKey(key, idem.DefaultMaxKeyLength); err != nil || again != key {
				t.Fatalf("bare form of %q parsed as %q, %v", key, again, err)
			}
		}
	})
}

// isToken reports whether key may be sent bare: only RFC 9651 token characters.
func isToken(key string) bool {
	return !strings.ContainsFunc(key, func(r rune) bool {
		return !strings.ContainsRune("!#$%&'*+-.^_`|~:/0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ", r)
	})
}
