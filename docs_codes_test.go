package idem

import (
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"testing"
)

// TestDocsStatusesAreTheCode: wherever a page of docs/ names an HTTP status
// beside one of idem's problem codes ("503 `idempotency_commit_failed`"), the
// status is the one the code answers with. docs/operating.md said an
// unknown-outcome commit gets 500 where the code answers 503.
func TestDocsStatusesAreTheCode(t *testing.T) {
	pages, err := filepath.Glob("docs/*.md")
	if err != nil || len(pages) == 0 {
		t.Fatalf("no docs pages: %v", err)
	}
	// "503 `idempotency_x`", and "500 when … `idempotency_x`" within one cell.
	pair := regexp.MustCompile("\\b([1-5][0-9][0-9]) `(idempotency_[a-z_]+)`")
	bare := regexp.MustCompile(`\b(5[0-9][0-9]) when a commit`)
	seen := 0
	for _, p := range pages {
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range pair.FindAllStringSubmatch(string(b), -1) {
			want, ok := problemTitles[m[2]]
			if !ok {
				t.Errorf("%s names %s, which is not a problem code", p, m[2])
				continue
			}
			seen++
			if got, _ := strconv.Atoi(m[1]); got != want.status {
				t.Errorf("%s: %s `%s`; the code answers %d", p, m[1], m[2], want.status)
			}
		}
		for _, m := range bare.FindAllStringSubmatch(string(b), -1) {
			if m[1] != strconv.Itoa(problemTitles[CodeCommitFailed].status) {
				t.Errorf("%s: %q; a commit that failed or whose outcome is unknown is answered %d %s", p, m[0], problemTitles[CodeCommitFailed].status, CodeCommitFailed)
			}
		}
	}
	if seen == 0 {
		t.Fatal("no status beside a problem code in docs/: the pattern is stale")
	}
}
