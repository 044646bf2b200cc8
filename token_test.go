package idem

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
)

func TestTokensAreUniqueUnderConcurrency(t *testing.T) {
	const goroutines, each = 16, 2000
	var mu sync.Mutex
	seen := make(map[string]bool, goroutines*each)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range goroutines {
		wg.Go(func() {
			<-start
			mine := make([]string, each)
			for i := range mine {
				mine[i] = newToken()
			}
			mu.Lock()
			defer mu.Unlock()
			for _, tok := range mine {
				if len(tok) != 22 {
					t.Errorf("token %q has %d characters, want 22", tok, len(tok))
				}
				if seen[tok] {
					t.Errorf("token %q was made twice", tok)
				}
				seen[tok] = true
			}
		})
	}
	close(start)
	wg.Wait()
}

// Tokens are unique across processes too: two processes (here, this test
// binary run twice more) draw different random prefixes, so the first tokens
// each makes — the same counter values — differ.
func TestTokensDifferAcrossProcesses(t *testing.T) {
	if os.Getenv("IDEM_TOKEN_HELPER") == "1" {
		fmt.Println("token:" + newToken() + " " + newToken())
		return
	}
	seen := map[string]bool{}
	for i := range 3 {
		cmd := exec.Command(os.Args[0], "-test.run=^TestTokensDifferAcrossProcesses$", "-test.count=1")
		cmd.Env = append(os.Environ(), "IDEM_TOKEN_HELPER=1")
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("helper process %d: %v\n%s", i, err, out)
		}
		_, line, ok := strings.Cut(string(out), "token:")
		if !ok {
			t.Fatalf("helper process %d printed no tokens:\n%s", i, out)
		}
		for _, tok := range strings.Fields(line)[:2] {
			if len(tok) != 22 {
				t.Fatalf("token %q has %d characters, want 22", tok, len(tok))
			}
			if seen[tok] {
				t.Fatalf("token %q was made by two processes", tok)
			}
			seen[tok] = true
		}
	}
}

// A request's first token lives in the request's own memory; a second one
// (the single-transaction flow may claim after its transaction) must not
// overwrite it, since the first may still be in use.
func TestRequestTokenKeepsTheFirst(t *testing.T) {
	req := &request{own: new(ownStrings)}
	first := req.newToken()
	kept := strings.Clone(first)
	second := req.newToken()
	if first != kept {
		t.Fatalf("the second token overwrote the first: %q became %q", kept, first)
	}
	if second == first || len(second) != tokenLen || len(first) != tokenLen {
		t.Fatalf("tokens %q and %q: want two different %d-character tokens", first, second, tokenLen)
	}
}
