// Package burst fires keyed POSTs at a test server all at once and counts the
// answers, for tests that prove a store's behaviour under concurrent
// duplicates.
package burst

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Answers counts the answers of a burst by status code; TransportError counts
// the requests that got no answer.
type Answers struct {
	Codes map[int]int
	// Failed holds the bodies of the 5xx answers.
	Failed []string
}

// TransportError is the Codes entry of requests that got no HTTP answer.
const TransportError = -1

// Keyed sends copies POSTs of an empty JSON object for each of keys keys
// ("cart-0", "cart-1", …, in the Idempotency-Key header) to url, all released
// at the same moment. ok is false when they had not all been answered within
// d: the caller fails its test then, without closing a server whose handlers
// may stand still for ever.
func Keyed(url string, keys, copies int, d time.Duration) (a Answers, ok bool) {
	a.Codes = map[int]int{}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		start = make(chan struct{})
	)
	client := &http.Client{Timeout: d}
	for k := range keys {
		for range copies {
			wg.Add(1)
			go func() {
				defer wg.Done()
				<-start
				req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{}`))
				if err != nil {
					panic(err)
				}
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("Idempotency-Key", fmt.Sprintf("cart-%d", k))
				resp, err := client.Do(req)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					a.Codes[TransportError]++
					return
				}
				b, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				a.Codes[resp.StatusCode]++
				if resp.StatusCode >= 500 {
					a.Failed = append(a.Failed, string(b))
				}
			}()
		}
	}
	close(start)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(d):
		return a, false
	}
	return a, true
}

// OnlyCreatedAndConflicts reports whether every request of the burst was
// answered 201 (first-time or replayed) or 409 (in flight), at least one 201.
func (a Answers) OnlyCreatedAndConflicts() bool {
	for code, n := range a.Codes {
		if n > 0 && code != http.StatusCreated && code != http.StatusConflict {
			return false
		}
	}
	return a.Codes[http.StatusCreated] > 0
}

// String shows the counts and the failed bodies.
func (a Answers) String() string {
	return fmt.Sprintf("%v %q", a.Codes, a.Failed)
}
