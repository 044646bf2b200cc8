package outbox

import (
	"context"
	"errors"
	"time"
)

// Source is what a store's outbox table offers the Relay. The store packages
// implement it (pgoutbox.Outbox, sqliteoutbox.Outbox, mysqloutbox.Outbox);
// every method is safe for concurrent use, from many relay processes at once.
type Source interface {
	// Lease leases to owner, for d, up to n messages that are ready: not
	// published, not dead-lettered, not leased (or whose lease lapsed), whose
	// retry time has come, and that are the oldest unpublished message of
	// their partition (the head). After a head it may also lease the
	// messages that follow it in its partition, in order and without a gap
	// (a run): no other relay can lease those while the head is unpublished.
	// The result is in seq order. Each lease counts as an attempt. Two
	// concurrent Lease calls never return the same message while its lease
	// holds.
	Lease(ctx context.Context, owner string, n int, d time.Duration) ([]Stored, error)
	// MarkPublished marks the messages published, those of seqs that owner
	// still leases; it returns how many it marked. A message whose lease
	// another owner has taken meanwhile stays as it is (that owner publishes
	// it again, with the same ID).
	MarkPublished(ctx context.Context, owner string, seqs ...int64) (int, error)
	// Retry ends owner's lease on message seq after a failed publication: it
	// becomes ready again after retryIn, with reason kept as its last error.
	Retry(ctx context.Context, owner string, seq int64, retryIn time.Duration, reason string) error
	// DeadLetter moves message seq, which owner leases, to the dead-letter
	// table with reason: it is never published, and the next message of its
	// partition becomes ready.
	DeadLetter(ctx context.Context, owner string, seq int64, reason string) error
	// DeletePublished deletes up to limit messages published more than
	// olderThan ago (by the database's clock) and returns how many.
	// Unpublished and dead-lettered messages are never deleted.
	DeletePublished(ctx context.Context, olderThan time.Duration, limit int) (int, error)
	// Stats counts what is in the table.
	Stats(ctx context.Context) (Stats, error)
}

// Stats is what a Source counts.
type Stats struct {
	// Pending counts the messages not yet published (nor dead-lettered).
	Pending int64
	// OldestPending is the age of the oldest of them (0 when there is none),
	// by the database's clock: the outbox's lag.
	OldestPending time.Duration
	// DeadLetters counts the dead-lettered messages.
	DeadLetters int64
}

// Publisher sends a message to a broker. Publish returns nil only after the
// broker confirmed it has the message (a JetStream PubAck, an AMQP publisher
// confirm): the relay then marks it published. It must be safe for
// concurrent use (the relay publishes the messages of different partitions
// at once) and must give the broker m.ID as the message's ID, so that the
// broker (JetStream's duplicate window) and the consumer deduplicate
// republications. An error wrapped with Permanent dead-letters the message;
// any other error is retried with backoff.
type Publisher interface {
	Publish(ctx context.Context, m *Stored) error
}

// PublisherFunc adapts a function to Publisher.
type PublisherFunc func(ctx context.Context, m *Stored) error

// Publish calls f.
func (f PublisherFunc) Publish(ctx context.Context, m *Stored) error { return f(ctx, m) }

type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as a failure that will never succeed however often the
// message is published again (the broker refused it as too large, no stream
// captures its subject, it is unroutable): the relay dead-letters the message
// with err's text as the reason instead of retrying it. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether err, or an error it wraps, was marked Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// ErrNoTx is what a store's Enqueue returns when it is given no transaction
// and ctx carries none of idem's.
var ErrNoTx = errors.New("outbox: no transaction: pass the handler's transaction (pgstore.Tx(ctx), sqlitestore.Tx(ctx), mysqlstore.Tx(ctx)) or one you opened, so that the message commits with your writes")
