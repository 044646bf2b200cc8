package checker_test

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/checker"
	"github.com/idemkit/idem/internal/checker/checkertest"
)

// TestNoContentServerPasses: a correct server whose answers carry nothing that
// tells executions apart (idem on memstore, PATCH answered 204 No Content) is
// not a caching server: two identical unmarked answers from a server that marks
// its replays are two executions.
func TestNoContentServerPasses(t *testing.T) {
	t.Parallel()
	for _, only := range [][]string{nil, {checker.CaseNewKey}, {checker.CaseTenantIsolation}} {
		t.Run(strings.Join(only, ","), func(t *testing.T) {
			t.Parallel()
			srv, executions := checkertest.NewNoContentServer()
			defer srv.Close()
			o := options(srv, false)
			o.URL, o.Method, o.Only, o.Concurrency = srv.URL+"/orders/ord_1", http.MethodPatch, only, 10
			rep := run(t, o)
			for _, c := range rep.Cases {
				// On a loaded machine the 20ms PATCH may end before the hang-up (a
				// skip); TestHangup checks that case on its own.
				if c.Result == checker.Fail || (c.Result == checker.Skip && c.Name != checker.CaseHangup) {
					t.Errorf("case %s: %s (%s), want pass", c.Name, c.Result, c.Summary)
				}
			}
			if executions.Load() == 0 {
				t.Error("the server executed nothing")
			}
			if t.Failed() {
				t.Log("\n" + table(rep))
			}
		})
	}
}

// caseHeader rewrites the server's Idempotent-Replayed: true to "TRUE".
type caseHeader struct {
	http.ResponseWriter
	wrote bool
}

func (c *caseHeader) WriteHeader(code int) {
	if c.wrote {
		return
	}
	c.wrote = true
	if c.Header().Get("Idempotent-Replayed") == "true" {
		c.Header().Set("Idempotent-Replayed", "TRUE")
	}
	c.ResponseWriter.WriteHeader(code)
}

func (c *caseHeader) Write(b []byte) (int, error) {
	c.WriteHeader(http.StatusOK)
	return c.ResponseWriter.Write(b)
}

// TestReplayedHeaderIgnoresCase: Idempotent-Replayed: TRUE marks a replay for
// the checker as it does for client.Replayed.
func TestReplayedHeaderIgnoresCase(t *testing.T) {
	t.Parallel()
	h := checkertest.Handler(checkertest.Correct)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.ServeHTTP(&caseHeader{ResponseWriter: w}, r)
	}))
	defer srv.Close()
	o := options(srv, false)
	o.Only = []string{checker.CaseReplay}
	rep := run(t, o)
	if c := rep.Case(checker.CaseReplay); c.Result != checker.Pass {
		t.Fatalf("replay = %s (%s), want pass for Idempotent-Replayed: TRUE", c.Result, c.Summary)
	}
}

// TestHangup: a client that hangs up mid-request and retries gets the replay
// of the one execution from a correct server; a server whose hang-up rolls the
// execution back and frees the key executes the retry again and fails, found
// both from the answers (it marks replays) and by counting.
func TestHangup(t *testing.T) {
	t.Parallel()
	tests := []struct {
		flaw  checkertest.Flaw
		after time.Duration
		want  checker.Result
	}{
		{checkertest.Correct, 0, checker.Pass},
		{checkertest.Correct, 5 * checkertest.Work, checker.Pass},
		{checkertest.HangupRollsBack, 0, checker.Fail},
		{checkertest.HangupRollsBack, 5 * checkertest.Work, checker.Fail},
	}
	for _, tt := range tests {
		for _, count := range []bool{false, true} {
			t.Run(tt.flaw.String()+"/"+tt.after.String()+map[bool]string{false: "/answers", true: "/count"}[count], func(t *testing.T) {
				t.Parallel()
				// Orders take 200ms, so that the hang-up falls well inside one
				// even on a loaded machine.
				srv := httptest.NewServer(checkertest.SlowHandler(tt.flaw, 10*checkertest.Work))
				defer srv.Close()
				o := options(srv, count)
				o.Only, o.HangupAfter = []string{checker.CaseHangup}, tt.after
				rep := run(t, o)
				c := rep.Case(checker.CaseHangup)
				if c == nil || c.Result != tt.want {
					t.Fatalf("hangup = %v, want %s:\n%s", c, tt.want, table(rep))
				}
				if tt.want == checker.Fail && !strings.Contains(c.Summary, "executed again") && !strings.Contains(c.Summary, "count URL lists 2") {
					t.Errorf("the failure does not say the retry executed again: %s", c.Summary)
				}
			})
		}
	}
}

// TestHangupSkipsFastEndpoint: an endpoint that answers at once cannot be hung
// up on mid-request; the case says how to make it possible.
func TestHangupSkipsFastEndpoint(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()
	rep := run(t, checker.Options{URL: srv.URL, Only: []string{checker.CaseHangup}})
	if c := rep.Case(checker.CaseHangup); c.Result != checker.Skip || !strings.Contains(c.Summary, "--hangup-after") {
		t.Fatalf("hangup = %s (%s), want a skip that names --hangup-after", c.Result, c.Summary)
	}
}
