package checker

import (
	"bytes"
	"context"
	"fmt"
	"mime"
	"net/http"
	"slices"
	"sort"
	"strings"

	"github.com/idemkit/idem/client"
)

// verdict collects what one case found.
type verdict struct {
	fails, warns, ev []string
}

func (v *verdict) fail(format string, args ...any) {
	v.fails = append(v.fails, fmt.Sprintf(format, args...))
}
func (v *verdict) warn(format string, args ...any) {
	v.warns = append(v.warns, fmt.Sprintf(format, args...))
}
func (v *verdict) note(lines ...string) { v.ev = append(v.ev, lines...) }

// done turns the findings into a Case: the first failure (else the first
// warning, else passSummary) is the summary, the other findings and the notes
// are the evidence. A passing case keeps no evidence.
func (v *verdict) done(passSummary string) Case {
	switch {
	case len(v.fails) > 0:
		return Case{Result: Fail, Summary: v.fails[0], Evidence: slices.Concat(v.fails[1:], v.warns, v.ev)}
	case len(v.warns) > 0:
		return Case{Result: Warn, Summary: v.warns[0], Evidence: slices.Concat(v.warns[1:], v.ev)}
	}
	return Case{Result: Pass, Summary: passSummary}
}

func skipped(format string, args ...any) Case {
	return Case{Result: Skip, Summary: fmt.Sprintf(format, args...)}
}

// status describes an answer in a few words.
func status(e *exchange) string {
	if e.err != nil {
		return "no answer (" + e.err.Error() + ")"
	}
	return fmt.Sprintf("%d %s", e.status, http.StatusText(e.status))
}

// bodyNote is an evidence line with the start of an answer's body.
func bodyNote(label string, e *exchange) string {
	return label + " body: " + excerpt(e.resp, 0, 160)
}

// checkProblem warns when a 4xx answer is not an RFC 9457 problem.
func checkProblem(v *verdict, e *exchange) {
	mt, _, _ := mime.ParseMediaType(e.header.Get("Content-Type"))
	if mt != "application/problem+json" {
		ct := e.header.Get("Content-Type")
		if ct == "" {
			ct = "missing"
		}
		v.warn("%d as expected, but Content-Type is %s, not application/problem+json (RFC 9457, as the IETF draft suggests)", e.status, ct)
	}
}

// firstExchange sends the run's first request once and returns it.
func (c *checker) firstExchange(ctx context.Context) *exchange {
	if !c.firstDone {
		c.firstDone = true
		c.first = c.send(ctx, newKey(), c.render(c.marker("first")))
		if c.first.replayed() {
			c.replayHeader = true
		}
		c.executed(c.first)
	}
	return c.first
}

// needFirst returns the first request when it succeeded, or the Case to report
// when it did not: a skip that points to first_request's failure, or a failure
// when first_request is not among the cases run (Options.Only).
func (c *checker) needFirst(ctx context.Context) (*exchange, *Case) {
	f := c.firstExchange(ctx)
	if !f.ok() {
		if c.o.only != nil && !c.o.only[CaseFirstRequest] {
			// first_request is not in the run to report the failure: skipping
			// would turn a dead or refusing server into a passing run.
			cs := Case{Result: Fail, Summary: fmt.Sprintf("the first request got %s, want 2xx, so there is nothing to retry (add %s to --only for its details)", status(f), CaseFirstRequest)}
			return nil, &cs
		}
		cs := skipped("the first request got %s, so there is nothing to retry; see %s", status(f), CaseFirstRequest)
		return nil, &cs
	}
	return f, nil
}

// learnMarking finds out, once per run, whether the server marks its replays
// when no answer has shown it yet: it sends key and body again — the retry of
// a completed operation — and notes a marked answer. It reports
// c.replayHeader.
func (c *checker) learnMarking(ctx context.Context, key string, body []byte, header http.Header) bool {
	if c.replayHeader || c.probed {
		return c.replayHeader
	}
	c.probed = true
	if e := c.sendAs(ctx, key, body, header); e.replayed() {
		c.replayHeader = true
	}
	return c.replayHeader
}

// checkCount adds a failure when the count URL does not list want resources.
func (c *checker) checkCount(ctx context.Context, v *verdict, marker string, want int, wrong string) (int, bool) {
	if c.o.CountURL == "" {
		return 0, false
	}
	n, err := c.count(ctx, marker)
	if err != nil {
		v.fail("could not count the resources: %v", err)
		return 0, false
	}
	if n != want {
		v.fail("the count URL lists %d resources for marker %s, want %d: %s", n, marker, want, wrong)
	}
	return n, true
}

func (c *checker) checkFirst(ctx context.Context) Case {
	var v verdict
	e := c.firstExchange(ctx)
	switch {
	case e.err != nil:
		v.fail("the request failed: %v", e.err)
		v.note("is the server running at " + c.o.URL + "?")
		return v.done("")
	case !e.ok():
		v.fail("got %s, want 2xx", status(e))
		v.note(bodyNote("answer", e))
		switch e.status {
		case http.StatusUnauthorized, http.StatusForbidden:
			v.note("pass credentials with --header 'Authorization: Bearer …'")
		case http.StatusNotFound, http.StatusMethodNotAllowed:
			v.note("check the URL and --method")
		case http.StatusBadRequest, http.StatusUnprocessableEntity:
			v.note("the endpoint may have refused the body; set --body to a request it accepts ({{marker}} keeps runs apart)")
		}
		return v.done("")
	}
	if e.replayed() {
		v.warn("a fresh key was answered with Idempotent-Replayed: true")
	}
	c.checkCount(ctx, &v, c.marker("first"), 1, "does the count URL filter by {{marker}}, and does the body carry it?")
	sum := status(e)
	if loc := e.header.Get("Location"); loc != "" {
		sum += ", Location " + loc
	}
	return v.done(sum)
}

func (c *checker) checkReplay(ctx context.Context) Case {
	f, skip := c.needFirst(ctx)
	if skip != nil {
		return *skip
	}
	var v verdict
	e := c.send(ctx, f.key, f.body)
	if e.err != nil {
		v.fail("the retry failed: %v", e.err)
		return v.done("")
	}
	if e.replayed() {
		c.replayHeader = true
	}
	if e.status != f.status {
		v.fail("the retry got %s, the first request %s: a retry must get the stored status", status(e), status(f))
		if e.status == http.StatusConflict {
			v.note("the first request was answered, so its outcome should be complete; is the answer sent before the outcome is stored?")
		}
	}
	if !bytes.Equal(e.resp, f.resp) {
		v.fail("the retry's body differs from the first answer: a replay must be byte-identical")
		v.note(diffLines("first", f.resp, "retry", e.resp)...)
	}
	if a, b := f.header.Get("Location"), e.header.Get("Location"); a != b {
		v.fail("the retry's Location %q differs from the first answer's %q", b, a)
	}
	_, counted := c.checkCount(ctx, &v, c.marker("first"), 1, "the retry ran the operation again")
	mark := e.replayMark()
	switch {
	case mark == "" && len(v.fails) == 0:
		v.warn("same status and body, but no Idempotent-Replayed: true header (Stripe's convention, docs/design.md §1): clients cannot tell a replay from an execution")
	case mark != "" && mark != client.ReplayedHeader:
		v.warn("the replay is marked with %s: true, but clients look for Idempotent-Replayed: true (Stripe's convention, what idem's client.Replayed reads; docs/design.md §1): rename the header, or send both", mark)
	}
	if mark == "" {
		mark = client.ReplayedHeader
	}
	sum := status(e) + ", byte-identical body, " + mark + ": true"
	if counted {
		sum += ", still 1 resource"
	}
	return v.done(sum)
}

func (c *checker) checkChangedBody(ctx context.Context) Case {
	f, skip := c.needFirst(ctx)
	if skip != nil {
		return *skip
	}
	if !c.templated() {
		return skipped("the body template has no {{marker}} or {{n}}, so no different body can be made from it")
	}
	var v verdict
	e := c.send(ctx, f.key, c.render(c.marker("changed")))
	switch {
	case e.err != nil:
		v.fail("the request failed: %v", e.err)
	case e.status == http.StatusUnprocessableEntity:
		checkProblem(&v, e)
	case e.ok() && bytes.Equal(e.resp, f.resp):
		v.fail("a different body with a used key got the first request's answer (%s): the key is not bound to the request it was first used with", status(e))
		v.note("a key reused with a different body must get 422 (IETF draft; docs/design.md §1), or a client's bug silently returns another operation's outcome")
	case e.ok():
		v.fail("a different body with a used key was executed (%s): a key reused with a different body must get 422", status(e))
		v.note(bodyNote("answer", e))
	case e.status >= 500:
		v.fail("a different body with a used key got %s, want 422", status(e))
		v.note(bodyNote("answer", e))
	default:
		v.warn("a different body with a used key got %s; the IETF draft and docs/design.md §1 say 422", status(e))
		v.note(bodyNote("answer", e))
	}
	return v.done("422 Unprocessable Entity, application/problem+json")
}

func (c *checker) checkNewKey(ctx context.Context) Case {
	f, skip := c.needFirst(ctx)
	if skip != nil {
		return *skip
	}
	var v verdict
	e := c.send(ctx, newKey(), f.body)
	c.executed(e)
	switch {
	case e.err != nil:
		v.fail("the request failed: %v", e.err)
		return v.done("")
	case e.status >= 500:
		v.fail("the first request's body under a new key got %s, want 2xx", status(e))
		v.note(bodyNote("answer", e))
		return v.done("")
	case !e.ok():
		v.warn("the first request's body under a new key got %s, want 2xx: a new key is a new operation (or does a business rule refuse duplicates?)", status(e))
		v.note(bodyNote("answer", e))
		return v.done("")
	case e.replayed():
		v.fail("the first request's body under a new key got a replay (Idempotent-Replayed: true): the API keys on the body, so two identical orders become one")
		return v.done("")
	}
	loc, firstLoc := e.header.Get("Location"), f.header.Get("Location")
	n, counted := c.checkCount(ctx, &v, c.marker("first"), 2, "a new key must execute a new operation")
	same := !counted && bytes.Equal(e.resp, f.resp) && loc == firstLoc
	// Two identical answers (a 204 without a body, say) are two executions, not
	// a cached answer, when the server marks its replays and marked neither.
	unmarked := same && !f.replayed() && c.learnMarking(ctx, f.key, f.body, c.o.Header)
	if same && !unmarked {
		v.fail("the first request's body under a new key got an identical answer (same body, same Location): does the API cache by body? A new key must execute a new operation")
		v.note(bodyNote("both", e))
		v.note("if the answer does not name the resource, pass --count-url to count on the server")
	}
	sum := status(e) + ", a new resource"
	switch {
	case counted:
		sum += fmt.Sprintf(" (count %d)", n)
	case loc != firstLoc:
		sum += ", Location " + loc
	case unmarked:
		sum = status(e) + ", a new execution (the same answer, not marked as a replay by a server that marks replays)"
	default:
		sum += " (a different body)"
	}
	return v.done(sum)
}

func (c *checker) checkMissingKey(ctx context.Context) Case {
	if c.o.KeyOptional {
		return skipped("keys are optional for this endpoint (--require-key=false)")
	}
	var v verdict
	e := c.send(ctx, "", c.render(c.marker("nokey")))
	switch {
	case e.err != nil:
		v.fail("the request failed: %v", e.err)
	case e.status == http.StatusBadRequest:
		checkProblem(&v, e)
	case e.ok():
		v.fail("a write without %s was executed (%s), want 400", c.o.KeyHeader, status(e))
		v.note("if keys are optional for this endpoint, pass --require-key=false")
	case e.status >= 500:
		v.fail("a write without %s got %s, want 400", c.o.KeyHeader, status(e))
		v.note(bodyNote("answer", e))
	default:
		v.warn("a write without %s got %s; the IETF draft and docs/design.md §1 say 400", c.o.KeyHeader, status(e))
	}
	return v.done("400 Bad Request, application/problem+json")
}

func (c *checker) checkLongKey(ctx context.Context) Case {
	var v verdict
	// Two keys of LongKeyLength characters that differ only in the last one: a
	// server that cuts keys to 255 characters takes them for one key.
	prefix := c.run + "-" + strings.Repeat("k", LongKeyLength-len(c.run)-2)
	key1, key2 := prefix+"1", prefix+"2"
	e := c.send(ctx, key1, c.render(c.marker("longkey")))
	switch {
	case e.err != nil:
		v.fail("the request failed: %v", e.err)
	case e.status == http.StatusBadRequest:
		checkProblem(&v, e)
	case e.ok():
		c.checkLongKeyKept(ctx, &v, e, key2)
	case e.status >= 500:
		v.fail("a %d-character key got %s: is the key column too short? Reject over-long keys with 400", LongKeyLength, status(e))
		v.note(bodyNote("answer", e))
	default:
		v.warn("a %d-character key got %s; docs/design.md §1 says 400", LongKeyLength, status(e))
	}
	return v.done("400 Bad Request, application/problem+json")
}

// checkLongKeyKept checks, after a LongKeyLength-character key was accepted
// (first), that a second one differing only after character 255 is a key of
// its own: a new operation, neither a replay nor a 422 or 409.
func (c *checker) checkLongKeyKept(ctx context.Context, v *verdict, first *exchange, key2 string) {
	marker := c.marker("longkey2")
	e := c.send(ctx, key2, c.render(marker))
	merged := fmt.Sprintf("two %d-character keys that differ only in character %d were taken for one key (the second got %%s): the server cuts keys short, so different operations share an outcome; reject keys over its limit with 400, never truncate them", LongKeyLength, LongKeyLength)
	switch {
	case e.err != nil:
		v.fail("the request with the second long key failed: %v", e.err)
		return
	case e.ok() && e.replayed():
		v.fail(merged, "a replay: Idempotent-Replayed: true")
		v.note(bodyNote("the first key's", first), bodyNote("the second key's", e))
		return
	case e.status == http.StatusUnprocessableEntity:
		v.fail(merged, "422, as for a key reused with another body")
		v.note(bodyNote("answer", e))
		return
	case e.status == http.StatusConflict:
		v.fail(merged, "409, as for a key in use")
		v.note(bodyNote("answer", e))
		return
	case !e.ok():
		v.warn("a second %d-character key got %s after the first was accepted", LongKeyLength, status(e))
		v.note(bodyNote("answer", e))
		return
	}
	c.checkCount(ctx, v, marker, 1, "the second long key's operation was not executed on its own")
	v.warn("%d-character keys were accepted (%s), each as a key of its own; docs/design.md §1 and Stripe allow at most 255 (a larger configured limit is allowed, but such keys are not portable)", LongKeyLength, status(first))
}

// tally counts answers by status, "error" for none.
type tally map[string]int

func (t tally) add(e *exchange) {
	if e.err != nil {
		t["error"]++
		return
	}
	if e.ok() && e.replayed() {
		t[fmt.Sprint(e.status)+" replayed"]++
		return
	}
	t[fmt.Sprint(e.status)]++
}

func (t tally) String() string {
	keys := make([]string, 0, len(t))
	for k := range t {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s×%d", k, t[k])
	}
	return strings.Join(parts, ", ")
}

func (c *checker) checkRace(ctx context.Context) Case {
	total := tally{}
	n := c.o.Concurrency
	for round := 1; round <= c.o.Rounds; round++ {
		marker := c.marker(fmt.Sprintf("race%d", round))
		res := c.fire(ctx, n, newKey(), c.render(marker))
		if err := ctx.Err(); err != nil {
			return Case{Result: Fail, Summary: "interrupted: " + err.Error()}
		}
		var v verdict
		c.judgeRace(ctx, &v, res, marker)
		for _, e := range res {
			total.add(e)
		}
		if len(v.fails) > 0 || len(v.warns) > 0 {
			cs := v.done("")
			if c.o.Rounds > 1 {
				cs.Summary = fmt.Sprintf("round %d of %d: %s", round, c.o.Rounds, cs.Summary)
			}
			return cs
		}
	}
	sum := fmt.Sprintf("%d requests at once, one execution: %s", n, total)
	if c.o.Rounds > 1 {
		sum = fmt.Sprintf("%d rounds of %d requests at once, one execution each: %s", c.o.Rounds, n, total)
	}
	if c.o.CountURL != "" {
		sum += ", count 1"
	}
	return Case{Result: Pass, Summary: sum}
}

// judgeRace judges the answers to one race: at most one execution, every 2xx
// answer identical, every other answer 409.
func (c *checker) judgeRace(ctx context.Context, v *verdict, res []*exchange, marker string) {
	t := tally{}
	var errs, oks, fresh, others []*exchange
	noRetryAfter := 0
	for _, e := range res {
		t.add(e)
		switch {
		case e.err != nil:
			errs = append(errs, e)
		case e.ok():
			oks = append(oks, e)
			if e.replayed() {
				c.replayHeader = true
			} else {
				fresh = append(fresh, e)
			}
		case e.status == http.StatusConflict:
			if e.header.Get("Retry-After") == "" {
				noRetryAfter++
			}
		default:
			others = append(others, e)
		}
	}
	v.note("statuses: " + t.String() + ", marker " + marker)
	if len(errs) > 0 {
		v.fail("%d of %d requests got no answer: %v", len(errs), len(res), errs[0].err)
		v.note("if the server is only slow, raise --timeout or lower --concurrency")
	}
	if len(oks) == 0 && len(errs) == 0 {
		v.fail("none of %d identical requests succeeded: one must execute and answer 2xx", len(res))
		if len(others) > 0 {
			v.note(bodyNote("an answer's", others[0]))
		}
	}
	c.checkCount(ctx, v, marker, 1, "the operation ran more than once")
	if d := distinct(oks); len(d) > 1 {
		if df := distinct(fresh); len(df) > 1 {
			v.fail("%d different bodies among %d 2xx answers: the operation ran more than once (a check-then-write race?)", len(df), len(oks))
			v.note(diffLines("answer 1", df[0].resp, "answer 2", df[1].resp)...)
			if !c.replayHeader {
				v.note("the server does not mark replays (Idempotent-Replayed), so these may also be replays that are not byte-identical: see the replay case")
			}
		} else {
			v.fail("replayed answers differ from the executed one: a replay must be byte-identical")
			v.note(diffLines("answer 1", d[0].resp, "answer 2", d[1].resp)...)
		}
	}
	for _, e := range oks[min(1, len(oks)):] {
		if e.status != oks[0].status {
			v.fail("2xx answers with different statuses (%d and %d): a replay repeats the stored status", oks[0].status, e.status)
			break
		}
	}
	if c.replayHeader && len(fresh) > 1 {
		v.fail("%d 2xx answers without Idempotent-Replayed: true, but only one request may execute", len(fresh))
	}
	if len(others) > 0 {
		rateLimited := true
		for _, e := range others {
			rateLimited = rateLimited && e.status == http.StatusTooManyRequests
		}
		if rateLimited {
			v.warn("%d requests were rate limited (429), so the race was smaller than asked; lower --concurrency", len(others))
		} else {
			v.fail("%d answers were neither 2xx nor 409: every request but the one that executes must get 409 (in flight) or the replay", len(others))
			v.note(bodyNote(fmt.Sprintf("a %d answer's", others[0].status), others[0]))
		}
	}
	if noRetryAfter > 0 {
		v.warn("%d 409 answers carry no Retry-After header (docs/design.md §1)", noRetryAfter)
	}
}

// distinct returns one exchange per distinct answer body, in order of appearance.
func distinct(es []*exchange) []*exchange {
	var out []*exchange
	seen := map[string]bool{}
	for _, e := range es {
		if !seen[string(e.resp)] {
			seen[string(e.resp)] = true
			out = append(out, e)
		}
	}
	return out
}

func (c *checker) checkTenant(ctx context.Context) Case {
	if len(c.o.TenantBHeader) == 0 {
		return skipped("pass --tenant-b-header (for example 'Authorization: Bearer <tenant B's token>') to check that tenants do not share keys")
	}
	var v verdict
	key, body := newKey(), c.render(c.marker("tenant"))
	a := c.send(ctx, key, body)
	if !a.ok() {
		v.fail("tenant A's request got %s, want 2xx", status(a))
		if a.err == nil {
			v.note(bodyNote("answer", a))
		}
		return v.done("")
	}
	hb := c.o.Header.Clone()
	if hb == nil {
		hb = http.Header{}
	}
	for k, vals := range c.o.TenantBHeader {
		hb[k] = vals
	}
	b := c.sendAs(ctx, key, body, hb)
	// Identical answers are two executions when the server marks its replays
	// and marked neither (an answer without a body, say).
	unmarked := b.ok() && !b.replayed() && !a.replayed() && bytes.Equal(b.resp, a.resp) &&
		c.learnMarking(ctx, key, body, c.o.Header)
	switch {
	case b.err != nil:
		v.fail("tenant B's request failed: %v", b.err)
	case b.ok() && !unmarked && (b.replayed() || bytes.Equal(b.resp, a.resp)):
		v.fail("tenant B, sending tenant A's key and body, got tenant A's answer (%s): records are not scoped by tenant, so one tenant can read another's outcomes", status(b))
		v.note(bodyNote("tenant A's", a), bodyNote("tenant B's", b))
	case b.ok():
		return v.done(status(b) + " for tenant B: its own execution, not tenant A's answer")
	case b.status == http.StatusUnauthorized || b.status == http.StatusForbidden:
		v.warn("tenant B was refused (%s); check --tenant-b-header", status(b))
	case b.status == http.StatusConflict || b.status == http.StatusUnprocessableEntity:
		v.warn("tenant B was refused because tenant A had used the key (%s): keys are shared across tenants, so one tenant can block another's; scope records by tenant (docs/design.md §1)", status(b))
		v.note(bodyNote("tenant B's", b))
	case b.status >= 500:
		v.warn("tenant B got %s", status(b))
		v.note(bodyNote("tenant B's", b))
	}
	return v.done(status(b) + " for tenant B, not tenant A's answer")
}
