package amqp_test

import (
	"sync"
	"time"

	"github.com/idemkit/idem/outbox"
)

type countObserver struct {
	outbox.NopObserver
	mu     sync.Mutex
	failed *int
}

func (c *countObserver) Failed(*outbox.Stored, error, time.Duration) {
	c.mu.Lock()
	*c.failed++
	c.mu.Unlock()
}

func (c *countObserver) n() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return *c.failed
}
