// Package exampletest holds what the store examples' tests share: a burst of
// requests with one key released at the same moment, a keyed POST, and random
// names for each test's own schema, database or key prefix.
package exampletest

import (
	"crypto/rand"
	"encoding/hex"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
)

// Burst sends n identical requests with one key at the same moment and returns
// the body of the 201 they share; every other answer must be 409 in flight.
func Burst(t *testing.T, url, key string, n int) string {
	t.Helper()
	type answer struct {
		status int
		body   string
	}
	answers := make([]answer, n)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			answers[i].status, _, answers[i].body = Post(t, url, key)
		}()
	}
	close(start)
	wg.Wait()
	created := ""
	for _, a := range answers {
		switch {
		case a.status == http.StatusCreated && (created == "" || created == a.body):
			created = a.body
		case a.status == http.StatusConflict:
		default:
			t.Fatalf("answer %d %q in a burst with one key; want one 201 body (replayed or not) and 409s; all: %v", a.status, a.body, answers)
		}
	}
	if created == "" {
		t.Fatalf("no 201 among %d requests with one key: %v", n, answers)
	}
	return created
}

// Post sends one keyed order to url on the default client and returns the
// status, the Idempotent-Replayed header and the body.
func Post(t *testing.T, url, key string) (status int, replayed, body string) {
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"cart_id":"c_42"}`))
	if err != nil {
		t.Error(err)
		return 0, "", ""
	}
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Error(err)
		return 0, "", ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), string(b)
}

// RandomHex returns 12 random hex digits, for names of a test's own.
func RandomHex(t *testing.T) string {
	b := make([]byte, 6)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}
