package idem_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// Every Go block in the README is code that CI builds and runs: the block is
// preceded by a `<!-- readme-excerpt: FILE -->` line, and its lines appear in
// FILE in the same order, consecutive, at one indentation.
func TestReadmeGoBlocksAreBuiltCode(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile("(?s)(?:<!-- readme-excerpt: ([^ ]+) -->\n)?```go\n(.*?)```")
	found := 0
	for _, m := range block.FindAllStringSubmatch(string(readme), -1) {
		found++
		file, code := m[1], m[2]
		first, _, _ := strings.Cut(code, "\n")
		if file == "" {
			t.Errorf("README Go block starting %q names no file: put a `<!-- readme-excerpt: FILE -->` line before it", first)
			continue
		}
		src, err := os.ReadFile(filepath.FromSlash(file))
		if err != nil {
			t.Errorf("README block from %s: %v", file, err)
			continue
		}
		if !containsIndented(string(src), code) {
			t.Errorf("README block starting %q is not in %s as written; copy it from the file", first, file)
		}
	}
	if found < 2 {
		t.Fatalf("found %d Go blocks in the README, want at least the quick start and the SQLite example", found)
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
