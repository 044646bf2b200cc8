package idemobs_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/idemkit/idem/idemobs"
)

// Redact hides a key and a scope of any size in each form a store error may
// name them — raw, Go-quoted, or cut short — and leaves the rest of the
// message alone. A scope of a megabyte takes one pass, not one per prefix
// length (which made a 900 KB scope hang the demo's logger).
func TestRedactForms(t *testing.T) {
	key := `order "42" \ ` + strings.Repeat("k", 300)
	scope := "tenant\n\x1b[31m\xff" + strings.Repeat("s", 1<<20)
	quote := func(s string) string { q := strconv.Quote(s); return q[1 : len(q)-1] }
	msg := fmt.Sprintf("pgstore: claim of key %q (%s…) in scope %s failed; raw %s; cut %s; short k%s",
		key, quote(key[:64]), quote(scope[:100]), scope[:5000], key[:20], "eep")
	got := idemobs.Redact(msg, key, scope)
	for _, leak := range []string{key[:16], quote(key[:16]), scope[:16], quote(scope[:16]), strings.Repeat("s", 64)} {
		if strings.Contains(got, leak) {
			t.Errorf("Redact left %q in %.300q", leak, got)
		}
	}
	for _, kept := range []string{"pgstore: claim of key", "in scope", "failed; raw", "short keep", "key#" + idemobs.KeyHash(scope, key), "scope#" + idemobs.Hash(scope)} {
		if !strings.Contains(got, kept) {
			t.Errorf("Redact lost %q: %.300q", kept, got)
		}
	}
}
