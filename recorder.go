package idem

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"

	"github.com/idemkit/idem/internal/eventseq"
)

// recorder is the ResponseWriter the handler of a claimed request writes to. It
// buffers the whole response, so that nothing reaches the client before the
// outcome is stored (and, with a TxStore, committed). Headers go straight into the
// real writer's header map, which is sent only when the outcome is settled; what
// middleware outside idem had put there before is kept aside (outer), so that a
// problem answer written instead of the handler's keeps it.
//
// A body larger than limit is not buffered past it: the recorder either spills
// (spill.spillOutcome stores the outcome without its body and the rest streams
// to the client) or, when spill is nil or a Step was refused as another
// request's (otherRequest), counts and discards the rest.
type recorder struct {
	w       http.ResponseWriter
	status  int
	body    bytes.Buffer
	scope   string
	key     string
	ref     string
	outer   http.Header    // a shallow copy of the writer's header map before the handler ran
	snap    headerSnapshot // the header map as it was when the handler wrote its status
	limited bool           // limit applies
	limit   int
	size    int // bytes the handler wrote
	mode    recorderMode
	spill   *request                // when set, its spillOutcome stores the outcome early; the recorder then streams
	written bool                    // the handler wrote its status (or a body)
	unknown bool                    // MarkOutcomeUnknown was called
	head    bool                    // the request is a HEAD: a Content-Length describes a body not sent
	pooled  *storedResponse         // whose storage body uses (usePooled); nil: its own
	req     *request                // the request the recorder belongs to (for Step)
	steps   atomic.Pointer[stepRun] // made by the first Step (step.go)
	// returned is set when the handler returned: a Step from then on (a
	// goroutine the handler left running) is refused, since its effect
	// would belong to no answer.
	returned atomic.Bool
	// events numbers the request's outbox messages by name (package outbox,
	// through internal/eventseq); made by the first message.
	events atomic.Pointer[eventseq.Counter]
	// otherRequest is set by a Step that found the step recorded for another
	// request with this key (ErrStepOtherRequest): the middleware answers 422
	// instead of the handler, stores nothing and releases the key.
	otherRequest atomic.Bool
}

func init() {
	eventseq.Lookup = func(ctx context.Context) *eventseq.Counter {
		rw, ok := ctx.Value(recorderKey{}).(*recorder)
		if !ok {
			return nil
		}
		if c := rw.events.Load(); c != nil {
			return c
		}
		rw.events.CompareAndSwap(nil, new(eventseq.Counter))
		return rw.events.Load()
	}
}

type recorderMode uint8

const (
	buffering  recorderMode = iota
	discarding              // over the limit, nothing more is kept
	streaming               // over the limit, spilled: writes go to the client
)

type recorderKey struct{}

// Header returns the header map of the underlying writer.
func (rw *recorder) Header() http.Header { return rw.w.Header() }

// WriteHeader records the status. Informational (1xx) statuses are ignored: they
// cannot be replayed. A status net/http refuses panics here as it would there,
// before it is stored: kept, it would make every replay panic.
func (rw *recorder) WriteHeader(status int) {
	if status < 100 || status > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", status))
	}
	if rw.written || status < 200 {
		return
	}
	rw.written = true
	rw.status = status
	// net/http sends the header map as it is at WriteHeader; what the handler
	// sets afterwards is not sent (only declared trailers are, after the body).
	// The real WriteHeader comes later, so what the map holds now is noted.
	rw.snap.take(rw.w.Header())
}

// headerSnapshot is a header map as it was at the handler's WriteHeader: its
// value slices (Set and Add give the map new ones; Add appends past the noted
// length), inline for up to 8 names, so that the common answer, whose header
// does not change after WriteHeader, costs no allocation.
type headerSnapshot struct {
	taken bool
	n     int
	kv    [8]headerEntry
	all   http.Header // a shallow copy, for more than 8 names
	built http.Header // the snapshot as a map, once one was needed
}

type headerEntry struct {
	k string
	v []string
}

func (s *headerSnapshot) take(h http.Header) {
	s.taken = true
	if len(h) > len(s.kv) {
		s.all = maps.Clone(h)
		return
	}
	for k, v := range h {
		s.kv[s.n] = headerEntry{k, v}
		s.n++
	}
}

// same reports whether h still holds what it held when the snapshot was taken.
func (s *headerSnapshot) same(h http.Header) bool {
	if s.built != nil {
		return false
	}
	if s.all != nil {
		if len(h) != len(s.all) {
			return false
		}
		for k, v := range s.all {
			if !sameValues(h, k, v) {
				return false
			}
		}
		return true
	}
	if len(h) != s.n {
		return false
	}
	for _, e := range s.kv[:s.n] {
		if !sameValues(h, e.k, e.v) {
			return false
		}
	}
	return true
}

func sameValues(h http.Header, k string, v []string) bool {
	hv, ok := h[k]
	return ok && len(hv) == len(v) && (len(v) == 0 || &hv[0] == &v[0])
}

// header returns the snapshot as a map.
func (s *headerSnapshot) header() http.Header {
	if s.built == nil {
		if s.all != nil {
			s.built = s.all
		} else {
			s.built = make(http.Header, s.n)
			for _, e := range s.kv[:s.n] {
				s.built[e.k] = e.v
			}
		}
	}
	return s.built
}

// header is the response's header: the map as it was when the handler wrote
// its status (or as it is, if the handler has not).
func (rw *recorder) header() http.Header {
	h := rw.w.Header()
	if !rw.snap.taken || rw.snap.same(h) {
		return h
	}
	return rw.snap.header()
}

// settleHeader makes the writer's header map what it was at the handler's
// WriteHeader, before it is sent. It returns the map as the handler left it
// (nil: the same), for restoreHeader after the body, so that trailers the
// handler set after writing reach net/http, which reads them when the handler
// returns.
func (rw *recorder) settleHeader() (late http.Header) {
	h := rw.w.Header()
	if !rw.snap.taken || rw.snap.same(h) {
		return nil
	}
	late = maps.Clone(h)
	clear(h)
	maps.Copy(h, rw.snap.header())
	return late
}

// restoreHeader puts back the header map settleHeader replaced.
func (rw *recorder) restoreHeader(late http.Header) {
	if late != nil {
		h := rw.w.Header()
		clear(h)
		maps.Copy(h, late)
	}
}

// Write buffers p, up to the limit.
func (rw *recorder) Write(p []byte) (int, error) {
	if !rw.written {
		rw.WriteHeader(http.StatusOK)
	}
	rw.size += len(p)
	switch rw.mode {
	case streaming:
		return rw.w.Write(p)
	case discarding:
		return len(p), nil
	}
	if rw.limited && rw.size > rw.limit {
		// A request one of whose steps was refused as another request's
		// (ErrStepOtherRequest) is answered 422 and keeps nothing: its body is
		// discarded rather than streamed and its outcome stored under it.
		if rw.spill != nil && !rw.otherRequest.Load() {
			rw.spill.spillOutcome()
			late := rw.settleHeader()
			rw.w.WriteHeader(rw.statusOrOK())
			_, _ = rw.w.Write(rw.body.Bytes())
			rw.restoreHeader(late)
			rw.body = bytes.Buffer{}
			rw.mode = streaming
			return rw.w.Write(p)
		}
		rw.mode = discarding
		rw.body = bytes.Buffer{}
		return len(p), nil
	}
	return rw.body.Write(p)
}

// overLimit reports whether the handler wrote more than the limit.
func (rw *recorder) overLimit() bool { return rw.mode != buffering }

// Unwrap returns the underlying writer, so that http.ResponseController can set
// deadlines through the recorder. Flushing is answered by the recorder itself.
func (rw *recorder) Unwrap() http.ResponseWriter { return rw.w }

// errHijack is what Hijack answers.
var errHijack = fmt.Errorf("idem: a keyed request's connection cannot be hijacked: what is written on it could not be stored or replayed: %w", http.ErrNotSupported)

// Hijack refuses. Without it, http.ResponseController would reach the
// connection through Unwrap: the handler would answer on it directly, and the
// empty 200 left in the recorder would be stored and replayed as the outcome.
func (rw *recorder) Hijack() (net.Conn, *bufio.ReadWriter, error) { return nil, nil, errHijack }

// Flush does nothing while the response is buffered until its outcome is stored
// (and committed); it makes the recorder an http.Flusher, so that
// http.ResponseController(w).Flush does not reach past it to the client. Once a
// response too large to keep streams, Flush flushes it.
func (rw *recorder) Flush() { _ = rw.FlushError() }

// FlushError is Flush, reporting the error of a streaming flush.
func (rw *recorder) FlushError() error {
	if rw.mode == streaming {
		return http.NewResponseController(rw.w).Flush()
	}
	return nil
}

func (rw *recorder) statusOrOK() int {
	if rw.status == 0 {
		return http.StatusOK
	}
	return rw.status
}

// send writes the buffered response to the client; a streaming response has
// been sent already.
func (rw *recorder) send() {
	if rw.mode == streaming {
		return
	}
	late := rw.settleHeader()
	h := rw.w.Header()
	if cl := h["Content-Length"]; len(cl) > 0 && !rw.head && bodyAllowed(rw.statusOrOK()) && (len(cl) > 1 || cl[0] != strconv.Itoa(rw.body.Len())) {
		// The handler declared a length its body does not have: net/http would
		// cut the body short or drop the connection, while the whole body is
		// what is stored and replayed. The first answer gets what retries get.
		h.Set("Content-Length", strconv.Itoa(rw.body.Len()))
	}
	setContentLength(h, rw.body.Len())
	rw.w.WriteHeader(rw.statusOrOK())
	_, _ = rw.w.Write(rw.body.Bytes())
	rw.restoreHeader(late)
}

// bodyAllowed reports whether a response with status may have a body.
func bodyAllowed(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

// snapshotHeaders keeps aside what is in the writer's header map before the
// handler runs.
func (rw *recorder) snapshotHeaders() {
	if h := rw.w.Header(); len(h) > 0 {
		rw.outer = maps.Clone(h)
	}
}

// discardHeaders removes what the handler put in the header map, before idem
// writes a problem instead of the handler's answer; what outer middleware had
// set (CORS, request IDs) stays.
func (rw *recorder) discardHeaders() {
	h := rw.w.Header()
	clear(h)
	maps.Copy(h, rw.outer)
}

// SetRef records a reference to the resource the handler created (an order ID, a
// URL). It is stored with the outcome as Response.Ref and handed to
// Config.ReplayFunc on every retry. It reports false, and does nothing, when ctx is
// not the context of a request idem is executing.
func SetRef(ctx context.Context, ref string) bool {
	rw, ok := ctx.Value(recorderKey{}).(*recorder)
	if ok {
		rw.ref = ref
	}
	return ok
}

// ErrOutcomeUnknown is the Err of the Observer event of a request whose
// handler called MarkOutcomeUnknown, and of one refused under LapsedRefuse.
var ErrOutcomeUnknown = errors.New("idem: the outcome of the operation is unknown")

// MarkOutcomeUnknown tells the middleware that the handler cannot know whether
// its operation took effect (an upstream service went away mid-request). The
// handler's answer is sent but neither stored nor replayed, the key is not
// released (with a TxStore the transaction is rolled back), and the record stays
// in flight until its lease lapses, at most Config.Lease later: retries get 409
// until then, and afterwards what Config.LapsedLease says. It reports false,
// and does nothing, when ctx is not the context of a request idem is executing.
// In the single-transaction flow the transaction is rolled back and the key
// claimed outside it, so that the record stays in flight in the same way.
func MarkOutcomeUnknown(ctx context.Context) bool {
	rw, ok := ctx.Value(recorderKey{}).(*recorder)
	if ok {
		rw.unknown = true
	}
	return ok
}

// KeyFrom returns the scope and idempotency key of the request idem is executing
// under ctx; ok is false outside such a request.
func KeyFrom(ctx context.Context) (scope, key string, ok bool) {
	rw, ok := ctx.Value(recorderKey{}).(*recorder)
	if !ok {
		return "", "", false
	}
	return rw.scope, rw.key, true
}
