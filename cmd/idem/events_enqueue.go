//go:build !idem_broken_outbox

package main

import (
	"context"

	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/outbox"
)

// demoEnqueue writes the order's event into the outbox, in the order's
// transaction. (The build tag idem_broken_outbox replaces it with the broken
// variants the pipeline proof must catch.)
func demoEnqueue(ctx context.Context, ev *demoEventsRun, tx orders.Tx, m outbox.Message) error {
	return ev.ob.enqueue(ctx, tx, m)
}

// demoPublisher is the demo relay's publisher, p itself (the build tag
// idem_broken_outbox wraps it).
func demoPublisher(p outbox.Publisher) outbox.Publisher { return p }
