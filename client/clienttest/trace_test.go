package clienttest_test

import (
	"context"
	"net/http"
	"net/http/httptrace"
	"net/textproto"
	"sync/atomic"
)

// httptraceWith1xx returns req's context with a trace that counts the 1xx
// interim answers the client receives.
func httptraceWith1xx(req *http.Request, n *atomic.Int64) context.Context {
	return httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
		Got1xxResponse: func(int, textproto.MIMEHeader) error { n.Add(1); return nil },
	})
}
