package idem

import (
	"bytes"
	"context"
	"net/http"
)

// recorder is the ResponseWriter the handler of a claimed request writes to. It
// buffers the whole response, so that nothing reaches the client before the
// outcome is stored (and, with a TxStore, committed). Headers go straight into the
// real writer's header map, which is sent only when the outcome is settled.
type recorder struct {
	w       http.ResponseWriter
	status  int
	body    bytes.Buffer
	scope   string
	key     string
	ref     string
	written bool
}

type recorderKey struct{}

// Header returns the header map of the underlying writer.
func (rw *recorder) Header() http.Header { return rw.w.Header() }

// WriteHeader records the status. Informational (1xx) statuses are ignored: they
// cannot be replayed.
func (rw *recorder) WriteHeader(status int) {
	if rw.written || status < 200 {
		return
	}
	rw.written = true
	rw.status = status
}

// Write buffers p.
func (rw *recorder) Write(p []byte) (int, error) {
	if !rw.written {
		rw.WriteHeader(http.StatusOK)
	}
	return rw.body.Write(p)
}

// Unwrap returns the underlying writer, so that http.ResponseController can set
// deadlines through the recorder. Flushing is answered by the recorder itself.
func (rw *recorder) Unwrap() http.ResponseWriter { return rw.w }

// Flush does nothing: the response is buffered until its outcome is stored (and
// committed), and only then sent. It makes the recorder an http.Flusher, so that
// http.ResponseController(w).Flush does not reach past it to the client.
func (rw *recorder) Flush() {}

// FlushError does nothing and returns nil; see Flush.
func (rw *recorder) FlushError() error { return nil }

func (rw *recorder) statusOrOK() int {
	if rw.status == 0 {
		return http.StatusOK
	}
	return rw.status
}

// send writes the buffered response to the client.
func (rw *recorder) send() {
	setContentLength(rw.w.Header(), rw.body.Len())
	rw.w.WriteHeader(rw.statusOrOK())
	_, _ = rw.w.Write(rw.body.Bytes())
}

// discardHeaders removes what the handler put in the header map, before idem
// writes a problem instead of the handler's answer.
func (rw *recorder) discardHeaders() {
	clear(rw.w.Header())
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

// KeyFrom returns the scope and idempotency key of the request idem is executing
// under ctx; ok is false outside such a request.
func KeyFrom(ctx context.Context) (scope, key string, ok bool) {
	rw, ok := ctx.Value(recorderKey{}).(*recorder)
	if !ok {
		return "", "", false
	}
	return rw.scope, rw.key, true
}
