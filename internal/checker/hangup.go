package checker

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Bounds of the wait between the retries of the hangup case while the
// hung-up request is still in flight (409).
const (
	hangupPollMin = 20 * time.Millisecond
	hangupPollMax = time.Second
)

// checkHangup hangs up in the middle of a request and retries it with the same
// key and body: the retry must get the replay of the one execution (after 409s
// while it still runs), and one resource must exist. A server that cancels the
// handler's work when its client goes away, rolls it back and releases the
// key executes the retry afresh: it fails.
func (c *checker) checkHangup(ctx context.Context) Case {
	after, how := c.o.HangupAfter, "--hangup-after"
	tries := 1
	if after == 0 {
		f, skip := c.needFirst(ctx)
		if skip != nil {
			return *skip
		}
		w := c.execWait
		if w == 0 {
			w = f.wait
		}
		if w < HangupMinWait {
			return skipped("the first request was answered %v after it was sent, too fast to hang up in the middle of one; pass --hangup-after DURATION, shorter than the endpoint takes (slow it down with a body it works longer on, or a server-side delay)", roundDuration(w))
		}
		// Half the shortest execution seen; a quarter, then an eighth, when the
		// answer still comes first (that execution was slow by chance).
		after, how, tries = w/2, fmt.Sprintf("half the %v an execution took", roundDuration(w)), 4
	}
	var v verdict
	var h, probe *exchange
	var key, marker string
	var body []byte
	for try := 1; ; try++ {
		marker = c.marker("hangup")
		if try > 1 {
			marker = c.marker(fmt.Sprintf("hangup%d", try))
		}
		key, body = newKey(), c.render(marker)
		h, probe = c.hangUpOn(ctx, key, body, after)
		if h.hungUp || h.err != nil || try >= tries {
			break
		}
		after /= 2
		how += ", halved"
	}
	switch {
	case h.err != nil && !h.hungUp:
		v.fail("the request to hang up on failed before the hang-up: %v", h.err)
		return v.done("")
	case !h.hungUp:
		return skipped("the answer (%s) came %v after the request, before the hang-up at %v (%s): pass a shorter --hangup-after", status(h), roundDuration(h.wait), roundDuration(after), how)
	}
	// Only a request the server showed to be in flight (409 to a second request
	// with its key) was surely begun when the client hung up; otherwise the
	// server may have got the hang-up first and rightly never executed it.
	inFlight := probe.status == http.StatusConflict
	v.note(fmt.Sprintf("hung up %v after sending the request (%s), key %s, marker %s; a request with the key just before the hang-up got %s", roundDuration(after), how, key, marker, status(probe)))
	// Retry with the same key and body until the answer is not "in flight".
	var r *exchange
	conflicts := 0
	deadline := time.Now().Add(c.o.Timeout)
	for {
		r = c.send(ctx, key, body)
		if r.err != nil || r.status != http.StatusConflict || !time.Now().Before(deadline) {
			break
		}
		conflicts++
		if err := sleepCtx(ctx, pollWait(r.header.Get("Retry-After"))); err != nil {
			return Case{Result: Fail, Summary: "interrupted: " + err.Error()}
		}
	}
	seen := status(r)
	if conflicts > 0 {
		seen = fmt.Sprintf("409×%d, then %s", conflicts, seen)
	}
	v.note("the retries got: " + seen)
	switch {
	case r.err != nil:
		v.fail("the retry after the hang-up failed: %v", r.err)
		return v.done("")
	case r.status == http.StatusConflict:
		v.fail("the retry after the hang-up still got 409 after %v: the request the client hung up on never completed, or its key stayed locked", c.o.Timeout)
		v.note(bodyNote("the last answer's", r))
		return v.done("")
	case !r.ok():
		v.fail("the retry after the hang-up got %s, want the replay of the execution the client hung up on: the outcome must not depend on whether the client waited for it", status(r))
		v.note(bodyNote("answer", r))
		if r.replayed() {
			v.note("that answer is a replay: the server stored a failure for the request the client hung up on; does the handler stop its work when the request's context is cancelled?")
		}
		return v.done("")
	}
	_, counted := c.checkCount(ctx, &v, marker, 1, "the hang-up and the retry must make one resource between them")
	switch {
	case r.replayed():
	case c.learnMarking(ctx, key, body, c.o.Header) && !inFlight:
		v.warn("the retry after the hang-up got %s without Idempotent-Replayed, but the request hung up on was not seen in flight (a request with its key got %s, not 409), so the server may never have begun it; pass a longer --hangup-after", status(r), status(probe))
	case c.replayHeader:
		v.fail("the retry after the hang-up was executed again (%s without Idempotent-Replayed, from a server that marks its replays): the hang-up undid the first execution and released its key — is the handler's transaction bound to the request context, which is cancelled when the client goes away?", status(r))
		v.note("a client that times out and retries must get the outcome of the one execution; side effects outside the transaction (a payment, an e-mail) happened twice")
	case !counted:
		v.warn("the retry after the hang-up got %s without Idempotent-Replayed, and the server does not mark replays: whether it executed again cannot be told; pass --count-url to count on the server", status(r))
	}
	sum := fmt.Sprintf("hung up after %v; the retry got %s, the replay of the one execution", roundDuration(after), seen)
	if counted {
		sum += ", 1 resource"
	}
	return v.done(sum)
}

// hangUpOn sends a request and, after the given time, a second one with the same
// key and body (the probe, which an in-flight request answers with 409); then it
// hangs up on the first, unless its answer came before. It returns both.
func (c *checker) hangUpOn(ctx context.Context, key string, body []byte, after time.Duration) (h, probe *exchange) {
	hctx, hangUp := context.WithCancelCause(ctx)
	defer hangUp(nil)
	wrote := make(chan struct{})
	var once sync.Once
	hctx = httptrace.WithClientTrace(hctx, &httptrace.ClientTrace{
		WroteRequest: func(httptrace.WroteRequestInfo) { once.Do(func() { close(wrote) }) },
	})
	done := make(chan *exchange, 1)
	go func() { done <- c.exchange(hctx, key, body, c.o.Header) }()
	answeredFirst := func(h *exchange) (*exchange, *exchange) {
		return h, &exchange{err: errors.New("not sent: the answer came first")}
	}
	select { // the time counts from the request's last byte
	case h = <-done:
		return answeredFirst(h)
	case <-wrote:
	}
	t := time.NewTimer(after)
	defer t.Stop()
	select {
	case h = <-done:
		return answeredFirst(h)
	case <-t.C:
	}
	probe = c.send(ctx, key, body)
	hangUp(errHungUp)
	return <-done, probe
}

// pollWait returns how long to wait before asking again after a 409 whose
// Retry-After is ra: its seconds, bounded to [hangupPollMin, hangupPollMax].
func pollWait(ra string) time.Duration {
	d := hangupPollMin
	if n, err := strconv.Atoi(strings.TrimSpace(ra)); err == nil && n > 0 {
		d = time.Duration(min(n, 3600)) * time.Second
	}
	return min(max(d, hangupPollMin), hangupPollMax)
}

// sleepCtx waits for d or until ctx ends, returning ctx's error then.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
