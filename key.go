package idem

import (
	"errors"
	"fmt"
	"strings"
)

// DefaultMaxKeyLength is the longest key accepted unless Config.MaxKeyLength says
// otherwise.
const DefaultMaxKeyLength = 255

// ErrInvalidKey is wrapped by every error ParseKey returns.
var ErrInvalidKey = errors.New("idem: invalid idempotency key")

// ParseKey parses one Idempotency-Key header value. It accepts both forms the
// world uses and returns the same key for both:
//
//   - the IETF form, an RFC 9651 sf-string: "8e03978e-40d5-43e8" (in quotes, with
//     \" and \\ as the only escapes);
//   - the bare form Stripe documents: 8e03978e-40d5-43e8.
//
// Leading and trailing spaces are ignored. The key itself must be 1 to maxLen
// characters of visible ASCII (0x21–0x7E). A bare key is an RFC 9651 token:
// letters, digits and !#$%&'*+-.^_`|~:/ (unlike a token it may start with a
// digit, as UUIDs do); other characters need the quoted form. Lists ("a", "b" or
// a, b — two header lines a proxy folded into one) and structured-field
// parameters (;a=1) are refused. Errors wrap ErrInvalidKey and say what is wrong.
func ParseKey(value string, maxLen int) (string, error) {
	v := strings.Trim(value, " \t")
	if v == "" {
		return "", fmt.Errorf("%w: the header is empty; send 1 to %d visible ASCII characters", ErrInvalidKey, maxLen)
	}
	var key string
	if v[0] == '"' {
		k, err := parseSfString(v)
		if err != nil {
			return "", err
		}
		key = k
	} else {
		key = v
		for i := 0; i < len(v); i++ {
			c := v[i]
			switch {
			case c == ',':
				return "", fmt.Errorf("%w: a comma at position %d; the header holds a list (two header lines folded into one?), send exactly one key", ErrInvalidKey, i)
			case c < 0x21 || c > 0x7e:
				return "", fmt.Errorf("%w: byte 0x%02x at position %d is not visible ASCII", ErrInvalidKey, c, i)
			case !tokenChar[c]:
				return "", fmt.Errorf("%w: %q at position %d is not allowed in a bare key (an RFC 9651 token); send the key as a quoted string (\"…\") to use it", ErrInvalidKey, c, i)
			}
		}
	}
	if key == "" {
		return "", fmt.Errorf("%w: the key is empty; send 1 to %d visible ASCII characters", ErrInvalidKey, maxLen)
	}
	if len(key) > maxLen {
		return "", fmt.Errorf("%w: the key has %d characters, more than the limit of %d", ErrInvalidKey, len(key), maxLen)
	}
	return key, nil
}

// parseSfString parses v, which starts with a double quote, as an RFC 9651
// sf-string whose characters must all be visible ASCII.
func parseSfString(v string) (string, error) {
	var b []byte // allocated only when an escape is seen
	start := 1
	for i := 1; i < len(v); i++ {
		c := v[i]
		switch {
		case c == '\\':
			if i+1 >= len(v) || (v[i+1] != '"' && v[i+1] != '\\') {
				return "", fmt.Errorf("%w: a backslash at position %d must be followed by \" or \\", ErrInvalidKey, i)
			}
			if b == nil {
				b = make([]byte, 0, len(v))
			}
			b = append(b, v[start:i]...)
			b = append(b, v[i+1])
			i++
			start = i + 1
		case c == '"':
			if i != len(v)-1 {
				return "", fmt.Errorf("%w: unexpected characters after the closing quote at position %d", ErrInvalidKey, i)
			}
			if b == nil {
				return v[1:i], nil
			}
			return string(append(b, v[start:i]...)), nil
		case c < 0x21 || c > 0x7e:
			return "", fmt.Errorf("%w: byte 0x%02x at position %d is not visible ASCII", ErrInvalidKey, c, i)
		}
	}
	return "", fmt.Errorf("%w: the opening quote is never closed", ErrInvalidKey)
}

// tokenChar reports the characters of an RFC 9651 sf-token: RFC 9110's tchar,
// ':' and '/'.
var tokenChar = func() (t [256]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c], t[c-'a'+'A'] = true, true
	}
	for _, c := range "!#$%&'*+-.^_`|~:/" {
		t[c] = true
	}
	return t
}()
