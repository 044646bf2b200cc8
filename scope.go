package idem

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"net/http"
	"strings"
	"unicode/utf8"
)

type scopeKey struct{}

// WithScope returns a copy of ctx that carries scope, the tenant or principal an
// authentication middleware in front of idem has established. The default
// Config.ScopeFunc reads it back, so that two tenants never share a key.
func WithScope(ctx context.Context, scope string) context.Context {
	return context.WithValue(ctx, scopeKey{}, scope)
}

// ScopeFrom returns the scope stored in ctx by WithScope, or "" when there is none.
func ScopeFrom(ctx context.Context) string {
	s, _ := ctx.Value(scopeKey{}).(string)
	return s
}

// ScopeFromContext is the default Config.ScopeFunc: it returns
// ScopeFrom(r.Context()). Requests that no authentication middleware has scoped
// all share the scope "".
func ScopeFromContext(r *http.Request) string {
	return ScopeFrom(r.Context())
}

// MaxStoredScopeLength is the longest scope a store is given as it is. Longer
// scopes, and scopes that are not printable UTF-8, are stored as their digest
// (see StoredScope), so that any scope works in every store.
const MaxStoredScopeLength = 128

// scopeDigestPrefix starts the stored form of a scope that is kept as a digest.
const scopeDigestPrefix = "sha256:"

// StoredScope returns the form of scope that the middleware hands to the store
// and to the Observer: scope itself when it is at most MaxStoredScopeLength bytes
// of valid UTF-8 without control characters, otherwise "sha256:" and the hex
// SHA-256 of scope (71 bytes). A scope that itself starts with "sha256:" is
// always digested, so two different scopes never share a stored form. Tools
// that look records up by scope (idem inspect) apply it too.
func StoredScope(scope string) string {
	if len(scope) <= MaxStoredScopeLength && printable(scope) && !strings.HasPrefix(scope, scopeDigestPrefix) {
		return scope
	}
	sum := sha256.Sum256([]byte(scope))
	var out [len(scopeDigestPrefix) + 2*sha256.Size]byte
	copy(out[:], scopeDigestPrefix)
	hex.Encode(out[len(scopeDigestPrefix):], sum[:])
	return string(out[:])
}

// printable reports whether s is valid UTF-8 without C0 or C1 control characters.
func printable(s string) bool {
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c < 0x20 || c == 0x7f {
				return false
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError || (r >= 0x80 && r <= 0x9f) {
			return false
		}
		i += size
	}
	return true
}
