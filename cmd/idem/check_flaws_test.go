package main

import (
	"bytes"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/internal/checker/checkertest"
)

// statusRewriter turns the replay's status into another one, as a server that
// re-renders replays (200 instead of the stored 201) does.
type statusRewriter struct {
	http.ResponseWriter
	to int
}

func (s statusRewriter) WriteHeader(code int) {
	if s.Header().Get("Idempotent-Replayed") == "true" {
		code = s.to
	}
	s.ResponseWriter.WriteHeader(code)
}

// bodyRewriter appends to a replay's body: same status, other bytes.
type bodyRewriter struct {
	http.ResponseWriter
}

func (b bodyRewriter) Write(p []byte) (int, error) {
	if b.Header().Get("Idempotent-Replayed") == "true" {
		b.Header().Del("Content-Length")
		n, err := b.ResponseWriter.Write(bytes.Replace(p, []byte(`"id"`), []byte(`"id" `), 1))
		if n > len(p) {
			n = len(p)
		}
		return n, err
	}
	return b.ResponseWriter.Write(p)
}

// stuck409 executes a key's first request (through the correct service) and
// answers every later one 409 in use, forever: a key that never leaves flight.
func stuck409(next http.Handler) http.Handler {
	var mu sync.Mutex
	seen := map[string]bool{}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("Idempotency-Key")
		if r.Method == http.MethodPost && key != "" {
			id := r.Header.Get("Authorization") + "\x00" + key
			mu.Lock()
			again := seen[id]
			seen[id] = true
			mu.Unlock()
			if again {
				w.Header().Set("Content-Type", "application/problem+json")
				w.Header().Set("Retry-After", "1")
				w.WriteHeader(http.StatusConflict)
				_, _ = w.Write([]byte(`{"type":"about:blank","title":"in use","status":409,"code":"idempotency_key_in_use"}`))
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

// TestCheckFailsBrokenServers runs the idem check command against servers that
// break the contract in one way each and wants exit 1 with the broken case
// named as failed and a detail that says what was wrong.
func TestCheckFailsBrokenServers(t *testing.T) {
	t.Parallel()
	correct := func() http.Handler { return checkertest.Handler(checkertest.Correct) }
	tests := []struct {
		name    string
		handler http.Handler
		fail    string // the case that must fail
		detail  string // in its line of the report
	}{
		{"executes duplicates", checkertest.Handler(checkertest.NoIdempotency), "replay", ""},
		{"replays another status", func() http.Handler {
			h := correct()
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				h.ServeHTTP(statusRewriter{w, http.StatusOK}, r)
			})
		}(), "replay", "200"},
		{"replays another body", func() http.Handler {
			h := correct()
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				h.ServeHTTP(bodyRewriter{w}, r)
			})
		}(), "replay", "body"},
		{"409 forever", stuck409(correct()), "replay", "409"},
		{"ignores tenants", checkertest.Handler(checkertest.SharedKeys), "tenant_isolation", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(tc.handler)
			defer srv.Close()
			code, out, errOut := runCheckCmd(t, srv.URL+"/orders",
				"--header", "Authorization: Bearer tenant-a",
				"--tenant-b-header", "Authorization: Bearer tenant-b",
				"--count-url", srv.URL+"/orders?cart_id={{marker}}",
				"--concurrency", "10", "--rounds", "2", "--timeout", "5s")
			if code != exitFailure {
				t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitFailure, out, errOut)
			}
			var line string
			for _, l := range strings.Split(out, "\n") {
				if f := strings.Fields(l); len(f) > 1 && f[0] == tc.fail {
					line = l
				}
			}
			if f := strings.Fields(line); len(f) < 2 || !strings.EqualFold(f[1], "fail") {
				t.Fatalf("case %s did not fail:\n%s", tc.fail, out)
			}
			if !strings.Contains(line, tc.detail) {
				t.Errorf("case %s: detail lacks %q: %s", tc.fail, tc.detail, line)
			}
			t.Logf("report:\n%s", out)
		})
	}
}

// TestCheckOnlyWithoutAnswer: a case that needs the first request (replay,
// changed_body, new_key, hangup), run alone with --only, against a server
// that is down or refuses the request (401: the user forgot --header), fails
// with exit 1 and says what the first request got. It was skipped, and the
// run reported "ok" with exit 0.
func TestCheckOnlyWithoutAnswer(t *testing.T) {
	t.Parallel()
	refusing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "no token", http.StatusUnauthorized)
	}))
	defer refusing.Close()
	servers := map[string]string{"down": "http://" + closedPort(t), "401": refusing.URL}
	for name, base := range servers {
		for _, only := range []string{"replay", "changed_body", "new_key", "hangup", "replay,missing_key"} {
			t.Run(name+"/"+only, func(t *testing.T) {
				t.Parallel()
				code, out, errOut := runCheckCmd(t, base+"/orders", "--only", only, "--timeout", "5s")
				if code != exitFailure {
					t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitFailure, out, errOut)
				}
				if !strings.Contains(out, "the first request got") || strings.Contains(out, ": ok") {
					t.Errorf("the report does not say the first request failed:\n%s", out)
				}
			})
		}
	}
	// With first_request in the run it fails there, and the cases that need
	// it are skipped with a pointer to it.
	code, out, _ := runCheckCmd(t, refusing.URL+"/orders", "--only", "first_request,replay")
	if code != exitFailure || !strings.Contains(out, "1 failed, 1 skipped") || !strings.Contains(out, "see first_request") {
		t.Errorf("first_request,replay against a 401 server: exit %d\n%s", code, out)
	}
}
