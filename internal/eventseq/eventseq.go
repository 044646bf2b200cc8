// Package eventseq numbers the outbox messages of one operation that share a
// name, so that each gets a default ID of its own: package idem keeps a
// Counter per request it executes and lends it to package outbox through
// Lookup, without a context value of its own.
package eventseq

import (
	"context"
	"sync"
)

// Counter counts, by name, the messages one operation has enqueued. The zero
// value is ready; it is safe for concurrent use (a handler may enqueue from
// several goroutines).
type Counter struct {
	mu   sync.Mutex
	seen map[string]int
}

// Next returns how many messages called name the operation has enqueued,
// this one included: 1 for the first.
func (c *Counter) Next(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.seen == nil {
		c.seen = make(map[string]int, 1)
	}
	c.seen[name]++
	return c.seen[name]
}

// Lookup returns the Counter of the request idem executes under ctx, or nil
// outside one. Package idem sets it when it is initialised; it is nil in a
// program that does not link package idem.
var Lookup func(ctx context.Context) *Counter
