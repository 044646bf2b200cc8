package idem

import (
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
