// Package outbox is the transactional outbox: a handler writes the events of
// a request into an outbox table in the same database transaction as its
// business writes and idem's stored answer, and a Relay publishes them after
// the commit, with a stable ID that the consumer side deduplicates.
//
// The package holds what does not depend on a database or a broker: Message,
// MessageID, Prepare (the checks and defaults every Enqueue applies), the
// Source a store's outbox table offers the relay, the Publisher a broker
// adapter implements, the Relay, and the Observer that sees what the relay
// does. The tables live in the store modules (pgstore/pgoutbox,
// sqlitestore/sqliteoutbox, mysqlstore/mysqloutbox: New, Migrate, Enqueue,
// DeadLetters, Redrive); the publishers are modules of their own
// (outbox/natsjs, outbox/amqp, outbox/watermill); idemprom.NewOutbox and
// idemotel.NewOutbox are Observers that export the relay's metrics;
// outbox/outboxtest is the conformance suite of a Source.
//
// In a request idem executes, a message's ID defaults to
// MessageID(scope, key, Message.Name) and its partition to the request's
// key. Elsewhere (a consumer's handler, a job) give the ID, or a context made
// with WithKey; Enqueue fails with ErrNoID otherwise.
//
// # Guarantees
//
//   - Enqueue writes in the caller's transaction: the message commits with
//     it or not at all. In a handler running in idem's transaction
//     (pgstore.Tx, sqlitestore.Tx, mysqlstore.Tx) that is the transaction
//     that stores the answer, so a replayed retry, which never runs the
//     handler, enqueues nothing, and a takeover after a crash enqueues only
//     what the committed attempt enqueued.
//   - The relay marks a message published only after the broker confirmed
//     it. A relay that crashes between the confirmation and the mark leaves
//     the message leased; once the lease lapses another relay (or the same
//     one, restarted) publishes it again, with the same ID: delivery is at
//     least once, and exactly once in effect for a consumer that
//     deduplicates by ID (idem's consumer package does).
//   - Order per partition: a relay leases a partition only through its
//     oldest unpublished message that has committed (the head-of-partition
//     rule), possibly with the messages behind it (a run, on PostgreSQL and
//     MySQL), and publishes a message only once every earlier committed one
//     of its partition was marked published (or refused for good). So a
//     message is never published before one of its partition whose
//     transaction committed before it was enqueued, and one transaction's
//     messages go in the order it enqueued them. Enqueue takes no lock on
//     the partition (transactions enqueuing into the same partitions in any
//     order never deadlock), so the messages of transactions open at the
//     same time go in either order: one that enqueued first but committed
//     last is published when it commits, possibly while a later one of its
//     partition is in flight. The partition defaults to the idempotency
//     key's (one transaction at a time); Message.PartitionKey names another
//     (a customer, an account), whose concurrent writers the application
//     serialises if it needs their order (docs/outbox.md).
//   - One message is never published by two relays at once while the
//     leases hold: a relay publishes a message only under a lease it took
//     and stops (its Publish context ends) before the lease lapses. The
//     remaining window is a relay stopped by the operating system (paused,
//     swapped) longer than the lease between the check and the broker's
//     receipt: then another relay may publish the same message, with the
//     same ID, at the same time.
//   - A broker outage loses nothing: a failed publication is retried with a
//     bounded exponential backoff (Relay.MaxBackoff) for as long as it takes,
//     without an operator. Only a failure the publisher marks Permanent
//     (too large for the broker, no stream for the subject, unroutable)
//     moves the message to the dead-letter table, with the reason.
//
// # Dead letters and order
//
// A dead-lettered message leaves its partition: the next message of that
// partition is published after it. A permanent failure is deterministic (the
// same message would be refused forever), so holding the partition would
// stop every later event of that key until an operator stepped in, which is
// what the outbox exists to avoid; the dead-letter row keeps the partition,
// the sequence number and the reason, so the gap is visible and the message
// can be repaired and enqueued again.
package outbox
