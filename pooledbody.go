package idem

import "bytes"

// maxPooledBody is the largest body buffer kept in responsePool for a later
// request; a larger one goes to the collector.
const maxPooledBody = 64 << 10

// usePooled takes a storedResponse from responsePool for the response the
// recorder buffers (the store copies what it keeps: middleware.reuseResponses)
// and buffers the body in its storage, so that a first-time request's body
// costs no allocation, nor the buffer's growth steps for a larger one.
// response takes it over; releasePooled returns it to the pool.
func (rw *recorder) usePooled() {
	sr := responsePool.Get().(*storedResponse)
	sr.owner = rw
	rw.pooled = sr
	rw.body = *bytes.NewBuffer(sr.buf[:0])
}

// releasePooled returns the recorder's storedResponse to responsePool, with
// the body's storage, once the request's last store call returned and its
// answer was sent. The recorder lets go of that storage first: a handler that
// kept its ResponseWriter past its return and writes again reaches a buffer
// of its own, never a later request's.
func (rw *recorder) releasePooled() {
	sr := rw.pooled
	if sr == nil {
		return
	}
	rw.pooled = nil
	if b := rw.body.Bytes(); cap(b) > 0 { // nil after a spill or the limit: sr.buf is as it was
		if cap(b) <= maxPooledBody {
			sr.buf = b[:0]
		} else {
			sr.buf = nil
		}
	}
	rw.body = bytes.Buffer{}
	sr.owner = nil
	sr.pooled = true
	sr.release()
}
