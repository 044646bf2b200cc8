package outbox

import "time"

// Observer sees what a Relay does, for metrics (idemprom.OutboxObserver,
// idemotel.OutboxObserver) or logs. Its methods are called from the relay's
// goroutines, possibly at once, and must not block. Embed NopObserver to
// implement only some of them.
type Observer interface {
	// Published: the broker confirmed m; lag is the time from its enqueue
	// to the confirmation.
	Published(m *Stored, lag time.Duration)
	// Failed: publishing m failed with err; it is retried in retryIn.
	Failed(m *Stored, err error, retryIn time.Duration)
	// DeadLettered: m was moved to the dead-letter table with reason.
	DeadLettered(m *Stored, reason string)
	// Batch: the relay leased n messages and handled them in d.
	Batch(n int, d time.Duration)
	// Stats: the outbox's counts, read every Relay.StatsInterval.
	Stats(s Stats)
	// SourceFailed: a call to the Source (the database) failed; the relay
	// waits and tries again.
	SourceFailed(err error)
	// Deleted: the retention deleted n published messages.
	Deleted(n int)
}

// NopObserver observes nothing. Embed it in an Observer that implements only
// some of the methods.
type NopObserver struct{}

// Published does nothing.
func (NopObserver) Published(*Stored, time.Duration) {}

// Failed does nothing.
func (NopObserver) Failed(*Stored, error, time.Duration) {}

// DeadLettered does nothing.
func (NopObserver) DeadLettered(*Stored, string) {}

// Batch does nothing.
func (NopObserver) Batch(int, time.Duration) {}

// Stats does nothing.
func (NopObserver) Stats(Stats) {}

// SourceFailed does nothing.
func (NopObserver) SourceFailed(error) {}

// Deleted does nothing.
func (NopObserver) Deleted(int) {}
