package idem

import (
	"fmt"
	"net/http"
)

// Replays: the stored outcome of a complete record, byte for byte, or rebuilt by
// Config.ReplayFunc.

// replay answers with the stored outcome of rec.
func (h *handler) replay(w http.ResponseWriter, req *request, rec *Record) {
	resp := rec.Response
	if resp == nil {
		h.storeFailed(w, req, "replay", fmt.Errorf("the store returned a complete record for key %q without a response", req.key))
		return
	}
	hdr := w.Header()
	if resp.BodyOmitted {
		if h.ReplayFunc == nil {
			h.problem(w, req, EventReplayed, nil, CodeResponseTooLarge, fmt.Sprintf("the operation already completed with status %d, but its response was not kept (larger than MaxStoredBody, or stored as a reference without a ReplayFunc); it cannot be replayed", resp.Status), 0)
			return
		}
		rw := req.recorder(w)
		hdr.Set(ReplayedHeader, "true") // before the ReplayFunc writes its status; discarded with its headers
		if err := h.ReplayFunc(rw, req.r, rec); err != nil {
			rw.discardHeaders()
			h.problem(w, req, EventReplayed, err, CodeReplayFailed, "the operation already completed, but its answer could not be rebuilt: "+err.Error(), 0)
			return
		}
		h.observe(req, Event{Kind: EventReplayed, Status: rw.statusOrOK()})
		rw.send()
		return
	}
	// The stored values are shared by every replay and must not reach a header
	// map that outer middleware may change: copy them, into one allocation.
	n := 1
	for _, v := range resp.Header {
		n += len(v)
	}
	vals := make([]string, 0, n)
	for k, v := range resp.Header {
		vals, hdr[k] = appendOwn(vals, v...)
	}
	_, hdr[ReplayedHeader] = appendOwn(vals, "true")
	setContentLength(hdr, len(resp.Body))
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
	h.observe(req, Event{Kind: EventReplayed, Status: resp.Status})
}
