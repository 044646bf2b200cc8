package client_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/client"
)

// blockingBody is a request body without GetBody (a pipe, a socket) whose
// Read blocks until Close, as a stalled upload does.
type blockingBody struct {
	reading chan struct{}
	closed  chan struct{}
	once    sync.Once
	rOnce   sync.Once
}

func (b *blockingBody) Read([]byte) (int, error) {
	b.rOnce.Do(func() { close(b.reading) })
	<-b.closed
	return 0, io.ErrClosedPipe
}

func (b *blockingBody) Close() error { b.once.Do(func() { close(b.closed) }); return nil }

// TestStalledUnrewindableBodyHonoursContext: a body without GetBody is copied
// before the first attempt; when its reader stalls, the request context must
// still end the operation (as with net/http's own client, whose attempt ends
// with its context whatever the body does), not hold the caller forever. The
// server is never reached.
func TestStalledUnrewindableBodyHonoursContext(t *testing.T) {
	t.Parallel()
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hits.Add(1); w.WriteHeader(201) }))
	t.Cleanup(srv.Close)
	body := &blockingBody{reading: make(chan struct{}), closed: make(chan struct{})}
	t.Cleanup(func() { _ = body.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, "POST", srv.URL+"/orders", body)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		resp, err := client.New(nil).Do(req)
		if resp != nil {
			resp.Body.Close()
		}
		done <- err
	}()
	<-body.reading
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("Do after the context ended: %v; want context.Canceled", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("Do still blocked 20 s after its context was cancelled: the body copy ignores the context")
	}
	if hits.Load() != 0 {
		t.Fatalf("the server got %d requests, want 0", hits.Load())
	}
}
