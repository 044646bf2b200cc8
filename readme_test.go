package idem_test

import (
	"os"

	"github.com/idemkit/idem"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// readmePages are the README and the docs/ pages that hold what the README
// held before it was cut to a first screen: every Go block in them is code.
var readmePages = []string{
	"README.md", "docs/http.md", "docs/errors.md", "docs/stores.md", "docs/cli.md",
	"docs/demo.md", "docs/grpc.md", "docs/routers.md", "docs/client.md", "docs/reliability.md",
	"docs/effects.md",
	"docs/outbox.md",
}

// Every Go block in the README (and in the pages that hold the README's
// former sections) is code that CI builds and runs: the block is preceded by a
// `<!-- readme-excerpt: FILE -->` line (FILE relative to the repository's
// root), and its lines appear in FILE in the same order, consecutive, at one
// indentation.
func TestReadmeGoBlocksAreBuiltCode(t *testing.T) {
	t.Parallel()
	block := regexp.MustCompile("(?s)(?:<!-- readme-excerpt: ([^ ]+) -->\n)?```go\n(.*?)```")
	for _, page := range readmePages {
		text, err := os.ReadFile(filepath.FromSlash(page))
		if err != nil {
			t.Fatal(err)
		}
		found := 0
		for _, m := range block.FindAllStringSubmatch(string(text), -1) {
			found++
			file, code := m[1], m[2]
			first, _, _ := strings.Cut(code, "\n")
			if file == "" {
				t.Errorf("%s: Go block starting %q names no file: put a `<!-- readme-excerpt: FILE -->` line before it", page, first)
				continue
			}
			src, err := os.ReadFile(filepath.FromSlash(file))
			if err != nil {
				t.Errorf("%s: block from %s: %v", page, file, err)
				continue
			}
			if !containsIndented(string(src), code) {
				t.Errorf("%s: block starting %q is not in %s as written; copy it from the file", page, first, file)
			}
		}
		if page == "README.md" && found < 2 {
			t.Fatalf("found %d Go blocks in the README, want at least the quick start and the SQLite example", found)
		}
	}
}

// TestProblemTypesResolve: every problem type idem sends names an anchor that
// exists on the page it points to, and the README keeps an anchor for every
// code, so the type URLs of answers stored before the documentation moved to
// docs/errors.md (they named README.md#code) still land on the code.
func TestProblemTypesResolve(t *testing.T) {
	t.Parallel()
	base, anchor, ok := strings.Cut(idem.ProblemTypeBase, "#")
	if !ok || anchor != "" {
		t.Fatalf("ProblemTypeBase %q does not end in a fragment", idem.ProblemTypeBase)
	}
	const repo = "https://github.com/idemkit/idem/blob/main/"
	page, ok := strings.CutPrefix(base, repo)
	if !ok {
		t.Fatalf("ProblemTypeBase %q is not a page of the repository", idem.ProblemTypeBase)
	}
	errorsPage, err := os.ReadFile(filepath.FromSlash(page))
	if err != nil {
		t.Fatal(err)
	}
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	codes := []string{
		idem.CodeKeyMissing, idem.CodeKeyInvalid, idem.CodeKeyInUse, idem.CodeKeyReused,
		idem.CodeBodyTooLarge, idem.CodeBodyUnreadable, idem.CodeStoreUnavailable, idem.CodeLeaseLost,
		idem.CodeCommitFailed, idem.CodeResponseTooLarge, idem.CodeReplayFailed, idem.CodeTxAborted,
		idem.CodeOutcomeUnknown, idem.CodeTxConflict,
		// the reference service's own codes (internal/orders) share the scheme
		"invalid_order", "unauthorized", "order_not_found", "invalid_query", "rate_limited",
		"order_not_saved", "database_error", "request_cancelled", "database_unavailable",
		"payment_failed", "payment_unavailable", "payment_unknown",
	}
	for _, code := range codes {
		a := `<a id="` + code + `"></a>`
		if !strings.Contains(string(errorsPage), a) {
			t.Errorf("%s has no anchor for %s", page, code)
		}
		if !strings.Contains(string(readme), a) {
			t.Errorf("README.md has no anchor for %s: a stored answer's type README.md#%s would not resolve", code, code)
		}
	}
}

// containsIndented reports whether src holds code's lines, consecutive, each
// indented by the same number of tabs.
func containsIndented(src, code string) bool {
	lines := strings.Split(strings.TrimRight(code, "\n"), "\n")
	for indent := 0; indent <= 3; indent++ {
		prefix := strings.Repeat("\t", indent)
		var b strings.Builder
		for _, l := range lines {
			if l != "" {
				b.WriteString(prefix)
			}
			b.WriteString(l)
			b.WriteByte('\n')
		}
		if strings.Contains(src, b.String()) {
			return true
		}
	}
	return false
}
