package orders

import (
	"fmt"
	"regexp"
	"strconv"
	"unicode"
	"unicode/utf8"
)

// idRE is the shape of the ids newID makes. Anything else cannot name an order,
// so it is answered without a query (PostgreSQL refuses NUL bytes and invalid
// UTF-8 in text parameters with an error, not an empty result).
var idRE = regexp.MustCompile(`^ord_[0-9a-f]{24}$`)

// idShape is what the answers say an order id looks like.
const idShape = "ord_ followed by 24 lowercase hex digits"

// checkText says what is wrong with a value the service stores or compares
// with stored text, or returns "" when it is fine: 1 to max bytes of UTF-8
// without control characters, and without leading or trailing white space
// (MySQL's utf8mb4_bin ignores trailing spaces when it compares, so "c_42 "
// would match "c_42").
func checkText(field, v string, max int) string {
	switch {
	case v == "":
		return field + " is empty"
	case len(v) > max:
		return fmt.Sprintf("%s is %d bytes long; the most is %d", field, len(v), max)
	case !utf8.ValidString(v):
		return field + " is not valid UTF-8"
	}
	for i, r := range v {
		if unicode.IsControl(r) {
			return fmt.Sprintf("%s contains a control character (%U) at byte %d; send printable text", field, r, i)
		}
	}
	first, _ := utf8.DecodeRuneInString(v)
	last, _ := utf8.DecodeLastRuneInString(v)
	if unicode.IsSpace(first) || unicode.IsSpace(last) {
		return field + " starts or ends with white space; trim it"
	}
	return ""
}

// maxQuoted is how many bytes of a client's value an answer or a log line
// repeats.
const maxQuoted = 64

// Quote returns v as a Go-quoted string, cut after 64 bytes with the full
// length noted, so that answers and logs never repeat unbounded or
// unprintable client input.
func Quote(v string) string {
	if len(v) <= maxQuoted {
		return strconv.Quote(v)
	}
	cut := maxQuoted
	for cut > 0 && !utf8.RuneStart(v[cut]) {
		cut--
	}
	return strconv.Quote(v[:cut]) + fmt.Sprintf("…(%d bytes)", len(v))
}

// b64token reports whether v is an RFC 6750 b64token: letters, digits and
// "-._~+/", then optional "=" padding.
func b64token(v string) bool {
	if v == "" {
		return false
	}
	i := 0
	for ; i < len(v); i++ {
		c := v[i]
		if 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '-' || c == '.' || c == '_' || c == '~' || c == '+' || c == '/' {
			continue
		}
		break
	}
	if i == 0 {
		return false
	}
	for ; i < len(v); i++ {
		if v[i] != '=' {
			return false
		}
	}
	return true
}
