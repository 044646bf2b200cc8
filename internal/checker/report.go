package checker

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Result is the outcome of one case.
type Result string

// The results a case can have. Only Fail makes a report fail.
const (
	Pass Result = "pass" // behaves as docs/design.md §1 and the IETF draft say
	Warn Result = "warn" // safe, but deviates from the contract or a convention
	Fail Result = "fail" // unsafe or wrong: a double execution, a wrong replay, …
	Skip Result = "skip" // not run: an option is missing or a prerequisite failed
)

// Case is the outcome of one case.
type Case struct {
	Name   string        // one of the Case… constants
	Result Result        // pass, warn, fail or skip
	Took   time.Duration // wall time of the case
	// Summary says in one line what was seen (and for a failure, what is wrong).
	Summary string
	// Evidence holds further lines: statuses seen, body diff excerpts, hints.
	Evidence []string
}

// Report is the outcome of one run.
type Report struct {
	URL         string
	Method      string
	Run         string // the run's identifier; every marker starts with it
	Concurrency int
	Rounds      int
	Started     time.Time
	Took        time.Duration
	Cases       []Case
}

// Failed reports whether any case failed.
func (r *Report) Failed() bool {
	for _, c := range r.Cases {
		if c.Result == Fail {
			return true
		}
	}
	return false
}

// Case returns the case with the given name, or nil when it was not run.
func (r *Report) Case(name string) *Case {
	for i := range r.Cases {
		if r.Cases[i].Name == name {
			return &r.Cases[i]
		}
	}
	return nil
}

// Count returns how many cases had the given result.
func (r *Report) Count(res Result) int {
	n := 0
	for _, c := range r.Cases {
		if c.Result == res {
			n++
		}
	}
	return n
}

// WriteTable writes the report as a table for people: one row per case, with
// its evidence indented below failures and warnings, and a closing tally.
func (r *Report) WriteTable(w io.Writer) error {
	var b strings.Builder
	fmt.Fprintf(&b, "idem check %s %s (run %s, concurrency %d", r.Method, r.URL, r.Run, r.Concurrency)
	if r.Rounds > 1 {
		fmt.Fprintf(&b, ", %d race rounds", r.Rounds)
	}
	b.WriteString(")\n\n")
	width := len("CASE")
	for _, c := range r.Cases {
		width = max(width, len(c.Name))
	}
	fmt.Fprintf(&b, "%-*s  %-6s  %8s  %s\n", width, "CASE", "RESULT", "TIME", "DETAIL")
	for _, c := range r.Cases {
		res := string(c.Result)
		if c.Result == Fail || c.Result == Warn {
			res = strings.ToUpper(res)
		}
		fmt.Fprintf(&b, "%-*s  %-6s  %8s  %s\n", width, c.Name, res, roundDuration(c.Took), c.Summary)
		for _, e := range c.Evidence {
			fmt.Fprintf(&b, "%*s%s\n", width+2+6+2+8+2+2, "", e)
		}
	}
	fmt.Fprintf(&b, "\n%d passed, %d warnings, %d failed, %d skipped in %s", r.Count(Pass), r.Count(Warn), r.Count(Fail), r.Count(Skip), roundDuration(r.Took))
	if r.Failed() {
		b.WriteString(": FAIL\n")
	} else {
		b.WriteString(": ok\n")
	}
	_, err := io.WriteString(w, b.String())
	return err
}

func roundDuration(d time.Duration) time.Duration {
	switch {
	case d >= 10*time.Second:
		return d.Round(100 * time.Millisecond)
	case d >= time.Second:
		return d.Round(10 * time.Millisecond)
	case d >= time.Millisecond:
		return d.Round(100 * time.Microsecond)
	}
	return d.Round(time.Microsecond)
}

// jsonReport is the shape of WriteJSON's output.
type jsonReport struct {
	URL         string     `json:"url"`
	Method      string     `json:"method"`
	Run         string     `json:"run"`
	Concurrency int        `json:"concurrency"`
	Rounds      int        `json:"rounds"`
	Started     time.Time  `json:"started"`
	DurationMS  float64    `json:"duration_ms"`
	Failed      bool       `json:"failed"`
	Passed      int        `json:"passed"`
	Warnings    int        `json:"warnings"`
	Failures    int        `json:"failures"`
	Skipped     int        `json:"skipped"`
	Cases       []jsonCase `json:"cases"`
}

type jsonCase struct {
	Name       string   `json:"name"`
	Result     Result   `json:"result"`
	DurationMS float64  `json:"duration_ms"`
	Summary    string   `json:"summary"`
	Evidence   []string `json:"evidence,omitempty"`
}

// WriteJSON writes the report as one indented JSON object: url, method, run,
// concurrency, rounds, started, duration_ms, failed, the tallies passed,
// warnings, failures and skipped, and cases (name, result, duration_ms,
// summary, evidence).
func (r *Report) WriteJSON(w io.Writer) error {
	out := jsonReport{
		URL: r.URL, Method: r.Method, Run: r.Run, Concurrency: r.Concurrency, Rounds: r.Rounds,
		Started: r.Started, DurationMS: ms(r.Took), Failed: r.Failed(),
		Passed: r.Count(Pass), Warnings: r.Count(Warn), Failures: r.Count(Fail), Skipped: r.Count(Skip),
		Cases: make([]jsonCase, 0, len(r.Cases)),
	}
	for _, c := range r.Cases {
		out.Cases = append(out.Cases, jsonCase{Name: c.Name, Result: c.Result, DurationMS: ms(c.Took), Summary: c.Summary, Evidence: c.Evidence})
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(out)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

// diffLines returns evidence lines showing where two bodies first differ.
func diffLines(labelA string, a []byte, labelB string, b []byte) []string {
	i := 0
	for i < len(a) && i < len(b) && a[i] == b[i] {
		i++
	}
	from := max(0, i-24)
	w := max(len(labelA), len(labelB))
	return []string{
		fmt.Sprintf("bodies differ at byte %d (%d vs %d bytes):", i, len(a), len(b)),
		fmt.Sprintf("  %-*s %s", w+1, labelA+":", excerpt(a, from, i+40)),
		fmt.Sprintf("  %-*s %s", w+1, labelB+":", excerpt(b, from, i+40)),
	}
}

// excerpt returns b[from:to] as printable text, with … where it was cut.
func excerpt(b []byte, from, to int) string {
	if len(b) == 0 {
		return "(empty)"
	}
	from = min(from, len(b))
	to = min(to, len(b))
	var s strings.Builder
	if from > 0 {
		s.WriteString("…")
	}
	for p := b[from:to]; len(p) > 0; {
		r, size := utf8.DecodeRune(p)
		p = p[size:]
		switch {
		case r == '\n':
			s.WriteString(`\n`)
		case r == '\r':
			s.WriteString(`\r`)
		case r == '\t':
			s.WriteString(`\t`)
		case r == utf8.RuneError && size <= 1:
			s.WriteByte('?')
		case !unicode.IsPrint(r):
			s.WriteString("·")
		default:
			s.WriteRune(r)
		}
	}
	if to < len(b) {
		s.WriteString("…")
	}
	return s.String()
}
