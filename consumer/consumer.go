// Package consumer gives message consumers the guarantee idem gives HTTP
// handlers: a broker delivers at least once, and the handler's effects happen
// once per message ID.
//
// A Processor runs one delivered message under a dedupe key through an
// idem.Store, with the same record states as an HTTP request: an atomic claim,
// a fenced lease renewed while the handler runs, a takeover when the holder
// crashed, the TTL and the janitor. The scope is the consumer's name (two
// consumers of one stream dedupe independently); the key is the message ID the
// producer set (JetStream's Nats-Msg-Id, AMQP's message_id, or a header you
// name), never a hash of the body; the fingerprint is a hash of the payload, so
// that one ID sent with two payloads is reported instead of silently skipped.
//
// With a store that implements idem.TxStore (sqlitestore, pgstore, mysqlstore)
// the handler writes through the store's transaction (sqlitestore.Tx(ctx),
// pgstore.Tx(ctx)) and its writes commit together with the "processed" record,
// or not at all; the adapters acknowledge the message only after that commit.
// With another store the record is written after the handler returns, so a
// crash between the two runs the handler again on redelivery.
//
// Process decides; the adapters (consumer/natsjs, consumer/amqp,
// consumer/watermill) carry the decision out on their broker:
//
//   - Ack: executed now, or processed before (a duplicate, acked without
//     running; its stored result is in Outcome.Result).
//   - Retry after Outcome.Delay: in flight on another instance (the lease
//     left), a handler error below Config.MaxDeliveries (Config.Backoff), or a
//     store failure.
//   - DeadLetter: a handler error at MaxDeliveries or marked Permanent, a
//     message past MaxDeliveries, one ID with a different payload, or a message
//     without a usable ID. Never dropped silently: every outcome is counted
//     (Stats) and reported (Config.OnOutcome).
package consumer

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

// Message is one delivery of a message, as an adapter hands it to Process.
type Message struct {
	// ID is the producer-set message ID: the dedupe key. 1 to 255 bytes of
	// visible ASCII (a UUID, a ULID, "order-42"…).
	ID string
	// Payload is the message body; its hash is the record's fingerprint.
	Payload []byte
	// Delivery is the number of this delivery, 1 for the first. 0 counts as 1.
	Delivery int
	// Header holds the message's headers, for the handler; not part of the
	// fingerprint.
	Header map[string][]string
}

// Handler processes one message. With a transactional store it writes through
// the transaction in ctx (for example sqlitestore.Tx(ctx)) and must not commit
// it. The result, if any, is stored with the record and returned as
// Outcome.Result for every later duplicate (for request-reply). An error
// rolls the transaction back and frees the key; wrap it with Permanent to
// dead-letter the message at once instead of retrying it.
type Handler func(ctx context.Context, msg *Message) (result []byte, err error)

// Action is what the adapter does with the delivery.
type Action uint8

const (
	// Ack acknowledges the delivery: the message is processed.
	Ack Action = iota + 1
	// Retry negatively acknowledges it, for redelivery after Outcome.Delay.
	Retry
	// DeadLetter removes it from the queue into the dead-letter destination
	// (JetStream Term plus an optional dead-letter subject, RabbitMQ's
	// dead-letter exchange, Watermill's poison queue).
	DeadLetter
)

// String returns "ack", "retry" or "dead-letter".
func (a Action) String() string {
	switch a {
	case Ack:
		return "ack"
	case Retry:
		return "retry"
	case DeadLetter:
		return "dead-letter"
	}
	return "unknown"
}

// Reason says why Process chose its Action.
type Reason uint8

// The reasons, one counter each in Stats.
const (
	// Executed: the handler ran and its outcome was stored (Ack).
	Executed Reason = iota + 1
	// Duplicate: the message was processed before; the handler did not run (Ack).
	Duplicate
	// InFlight: another delivery of the ID holds the key right now (Retry after
	// the lease left).
	InFlight
	// Failed: the handler failed and will be retried (Retry after Backoff).
	Failed
	// Poison: the handler failed at MaxDeliveries, or with a Permanent error, or
	// the message came past MaxDeliveries (DeadLetter).
	Poison
	// Mismatch: the ID was first processed with a different payload; the handler
	// did not run (DeadLetter).
	Mismatch
	// InvalidID: the message has no usable ID (DeadLetter).
	InvalidID
	// StoreFailed: the store failed; nothing was committed (Retry after Backoff),
	// or, with a store without transactions, the handler's effects happened but
	// the record could not be written (Ack, so they do not happen twice).
	StoreFailed
	// LeaseLost: the lease lapsed and another delivery took the key over; nothing
	// this one did was committed (Retry: the redelivery finds the other's outcome).
	LeaseLost
	numReasons
)

var reasonNames = [numReasons]string{"", "executed", "duplicate", "in_flight", "failed", "poison", "mismatch", "invalid_id", "store_failed", "lease_lost"}

// String returns the reason's snake_case name.
func (r Reason) String() string {
	if r < numReasons && r > 0 {
		return reasonNames[r]
	}
	return "unknown"
}

// Outcome is the decision for one delivery.
type Outcome struct {
	// Action is what the adapter does with the delivery.
	Action Action
	// Delay is how long the broker should wait before redelivering (Retry).
	Delay time.Duration
	// Reason says why.
	Reason Reason
	// Result is the handler's result: from this run (Executed) or stored by the
	// run that processed the message (Duplicate).
	Result []byte
	// Err is the handler's or the store's error, if any.
	Err error
}

// Config configures a Processor. Name is required.
type Config struct {
	// Name is the consumer's name, the scope of its records: consumers with
	// different names dedupe independently. Required.
	Name string
	// Lease is how long a claim holds the key before another delivery may take it
	// over; it is renewed every Lease/3 while the handler runs. Default 30 s.
	Lease time.Duration
	// TTL is how long a processed record is kept: a duplicate arriving later runs
	// again. Keep it longer than the broker's redelivery and the producer's
	// dedupe windows. Default 24 h.
	TTL time.Duration
	// MaxDeliveries is how many deliveries a failing message gets before it is
	// dead-lettered. Default 5.
	MaxDeliveries int
	// Backoff is the redelivery delay after the failed delivery number n (1, 2,
	// …). Default: 1 s doubling per delivery, at most 1 min.
	Backoff func(n int) time.Duration
	// HandlerTimeout ends the handler's context this long after it starts; 0
	// means none. With a store that has transactions, a handler that returns
	// after its context ended, even one that ignored it, commits nothing: the
	// delivery is retried as a failed one.
	HandlerTimeout time.Duration
	// CleanupTimeout bounds the store calls after the handler (completion,
	// commit, release). Default 10 s.
	CleanupTimeout time.Duration
	// NowFunc is the clock. Default time.Now.
	NowFunc func() time.Time
	// OnOutcome, when set, is called with every decision, from the goroutine that
	// called Process.
	OnOutcome func(msg *Message, out Outcome)
}

// DefaultBackoff is the default Config.Backoff: 1 s doubling per failed
// delivery, at most 1 min.
func DefaultBackoff(n int) time.Duration {
	if n < 1 {
		n = 1
	}
	if n > 7 {
		return time.Minute
	}
	return min(time.Second<<(n-1), time.Minute)
}

// Processor runs messages under their IDs. It is safe for concurrent use.
type Processor struct {
	cfg     Config
	scope   string
	store   idem.Store
	txStore idem.TxStore
	counts  [numReasons]atomic.Int64
}

// New returns a Processor that keeps its records in store. It returns an error,
// saying what to change, when cfg is invalid.
func New(store idem.Store, cfg Config) (*Processor, error) {
	if store == nil {
		return nil, errors.New("consumer: store is nil; pass an idem.Store (sqlitestore, pgstore, mysqlstore, redisstore, memstore)")
	}
	if cfg.Name == "" {
		return nil, errors.New("consumer: Config.Name is empty; name the consumer (the scope of its records), for example \"orders-worker\"")
	}
	if cfg.Lease == 0 {
		cfg.Lease = 30 * time.Second
	}
	if cfg.TTL == 0 {
		cfg.TTL = 24 * time.Hour
	}
	if cfg.MaxDeliveries == 0 {
		cfg.MaxDeliveries = 5
	}
	if cfg.Backoff == nil {
		cfg.Backoff = DefaultBackoff
	}
	if cfg.CleanupTimeout == 0 {
		cfg.CleanupTimeout = 10 * time.Second
	}
	if cfg.NowFunc == nil {
		cfg.NowFunc = time.Now
	}
	switch {
	case cfg.Lease < 3*time.Millisecond:
		return nil, fmt.Errorf("consumer: Config.Lease %v is too short; use at least a few seconds (longer than the store's round trip times three)", cfg.Lease)
	case cfg.TTL < cfg.Lease:
		return nil, fmt.Errorf("consumer: Config.TTL %v is shorter than Config.Lease %v; keep records at least as long as a lease (24 h is usual)", cfg.TTL, cfg.Lease)
	case cfg.MaxDeliveries < 1:
		return nil, fmt.Errorf("consumer: Config.MaxDeliveries %d must be at least 1", cfg.MaxDeliveries)
	case cfg.HandlerTimeout < 0 || cfg.CleanupTimeout < 0:
		return nil, errors.New("consumer: Config.HandlerTimeout and Config.CleanupTimeout must not be negative")
	}
	p := &Processor{cfg: cfg, scope: idem.StoredScope(cfg.Name), store: store}
	p.txStore, _ = store.(idem.TxStore)
	return p, nil
}

// Name returns the consumer's name.
func (p *Processor) Name() string { return p.cfg.Name }

// MaxDeliveries returns Config.MaxDeliveries (with its default applied), for
// adapters that configure the broker's own limit above it.
func (p *Processor) MaxDeliveries() int { return p.cfg.MaxDeliveries }

// Backoff returns Config.Backoff(n) (with its default applied), for adapters
// that count attempts themselves.
func (p *Processor) Backoff(n int) time.Duration { return p.cfg.Backoff(n) }

// Stats counts the outcomes of a Processor since it was made, by Reason.
type Stats struct {
	Executed, Duplicate, InFlight, Failed, Poison, Mismatch, InvalidID, StoreFailed, LeaseLost int64
}

// Stats returns the counts so far.
func (p *Processor) Stats() Stats {
	c := &p.counts
	return Stats{
		Executed: c[Executed].Load(), Duplicate: c[Duplicate].Load(), InFlight: c[InFlight].Load(),
		Failed: c[Failed].Load(), Poison: c[Poison].Load(), Mismatch: c[Mismatch].Load(),
		InvalidID: c[InvalidID].Load(), StoreFailed: c[StoreFailed].Load(), LeaseLost: c[LeaseLost].Load(),
	}
}

// permanentError marks a handler error that retrying cannot fix.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as permanent: the message is dead-lettered at once
// instead of being retried. Permanent(nil) is nil.
func Permanent(err error) error {
	if err == nil {
		return nil
	}
	return &permanentError{err}
}

// IsPermanent reports whether err, or an error it wraps, was marked Permanent.
func IsPermanent(err error) bool {
	var p *permanentError
	return errors.As(err, &p)
}

// Fingerprint is the fingerprint of a payload: "m1:" and its hex SHA-256.
func Fingerprint(payload []byte) string {
	sum := sha256.Sum256(payload)
	return "m1:" + hex.EncodeToString(sum[:])
}

func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return base64.RawURLEncoding.EncodeToString(b[:])
}

// Process runs msg through h unless its ID was processed already, and returns
// what the adapter must do with the delivery. It never panics on a handler
// panic's behalf: a panic releases the key and goes on.
func (p *Processor) Process(ctx context.Context, msg *Message, h Handler) Outcome {
	out := p.process(ctx, msg, h)
	p.counts[out.Reason].Add(1)
	if p.cfg.OnOutcome != nil {
		p.cfg.OnOutcome(msg, out)
	}
	return out
}

func (p *Processor) process(ctx context.Context, msg *Message, h Handler) Outcome {
	key, err := idem.ParseKey(msg.ID, idem.DefaultMaxKeyLength)
	if err != nil || key != msg.ID {
		if err == nil {
			err = fmt.Errorf("the ID %q is not in its plain form", msg.ID)
		}
		return Outcome{Action: DeadLetter, Reason: InvalidID, Err: fmt.Errorf("consumer %s: the message has no usable ID (%w); producers must set one per message (Nats-Msg-Id, AMQP message_id) and keep it across retries", p.cfg.Name, err)}
	}
	delivery := max(msg.Delivery, 1)
	now := p.cfg.NowFunc()
	claim := idem.ClaimRequest{
		Scope: p.scope, Key: key, Fingerprint: Fingerprint(msg.Payload), Token: newToken(),
		Now: now, LeaseUntil: now.Add(p.cfg.Lease), ExpiresAt: now.Add(p.cfg.TTL),
	}
	rec, claimed, err := p.store.Claim(ctx, claim)
	if err != nil {
		return p.storeFailed(delivery, fmt.Errorf("claim: %w", err))
	}
	if !claimed {
		switch {
		case rec.Fingerprint != claim.Fingerprint:
			return Outcome{Action: DeadLetter, Reason: Mismatch, Err: fmt.Errorf("consumer %s: message %q was first processed with a different payload (a %s record); a message ID names one message, so the producer must give a new message a new ID", p.cfg.Name, key, rec.State)}
		case rec.State == idem.StateComplete:
			var result []byte
			if rec.Response != nil {
				result = rec.Response.Body
			}
			return Outcome{Action: Ack, Reason: Duplicate, Result: result}
		default:
			left := rec.LeaseUntil.Sub(now)
			return Outcome{Action: Retry, Reason: InFlight, Delay: max(left, 10*time.Millisecond)}
		}
	}
	if delivery > p.cfg.MaxDeliveries {
		// Past the limit without a stored outcome: every earlier delivery failed or
		// crashed its consumer. Give the key up and dead-letter the message.
		err := p.release(ctx, key, claim.Token)
		return Outcome{Action: DeadLetter, Reason: Poison, Err: errors.Join(fmt.Errorf("consumer %s: message %q came for the %d. time, past MaxDeliveries (%d), without being processed", p.cfg.Name, key, delivery, p.cfg.MaxDeliveries), err)}
	}
	return p.execute(ctx, msg, key, claim.Token, delivery, h)
}

// storeFailed is the outcome of a store failure before anything committed.
func (p *Processor) storeFailed(delivery int, err error) Outcome {
	return Outcome{Action: Retry, Reason: StoreFailed, Delay: p.cfg.Backoff(delivery), Err: fmt.Errorf("consumer %s: the idempotency store failed, nothing was committed and the message will be redelivered: %w", p.cfg.Name, err)}
}

// handlerFailed is the outcome of a handler error (nothing committed).
func (p *Processor) handlerFailed(delivery int, err error) Outcome {
	if IsPermanent(err) || delivery >= p.cfg.MaxDeliveries {
		return Outcome{Action: DeadLetter, Reason: Poison, Err: err}
	}
	return Outcome{Action: Retry, Reason: Failed, Delay: p.cfg.Backoff(delivery), Err: err}
}

func (p *Processor) cleanup(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), p.cfg.CleanupTimeout)
}

// release gives the key up; a key no longer held under token is nothing to undo.
func (p *Processor) release(ctx context.Context, key, token string) error {
	cctx, cancel := p.cleanup(ctx)
	defer cancel()
	err := p.store.Release(cctx, p.scope, key, token)
	if errors.Is(err, idem.ErrLockLost) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("release (the key stays claimed until its lease lapses): %w", err)
	}
	return nil
}

// execute runs the handler of a claimed message and settles its outcome.
func (p *Processor) execute(ctx context.Context, msg *Message, key, token string, delivery int, h Handler) (out Outcome) {
	hctx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	defer cancel(nil)
	if p.cfg.HandlerTimeout > 0 {
		var stop context.CancelFunc
		hctx, stop = context.WithTimeoutCause(hctx, p.cfg.HandlerTimeout, context.DeadlineExceeded)
		defer stop()
	}
	// ctx ending (the consumer shutting down) does not cut a claimed handler
	// short: its outcome is settled and committed, as an HTTP request's is.
	var tx idem.Tx
	runCtx := hctx
	if p.txStore != nil {
		var err error
		runCtx, tx, err = p.txStore.BeginTx(hctx)
		if err != nil {
			return p.storeFailed(delivery, errors.Join(fmt.Errorf("begin transaction: %w", err), p.release(ctx, key, token)))
		}
	}
	renew := p.renew(hctx, cancel, key, token)
	settled := false
	defer func() {
		if settled {
			return
		}
		// The handler panicked: undo, release, report it as a failed delivery.
		v := recover()
		renew()
		cctx, stop := p.cleanup(ctx)
		defer stop()
		if tx != nil {
			_ = tx.Rollback(cctx)
		}
		out = p.handlerFailed(delivery, errors.Join(fmt.Errorf("consumer %s: the handler panicked: %v", p.cfg.Name, v), p.release(ctx, key, token)))
	}()
	result, herr := h(runCtx, msg)
	settled = true
	renew()

	cctx, stop := p.cleanup(ctx)
	defer stop()
	lost := errors.Is(context.Cause(hctx), idem.ErrLockLost)
	if herr != nil {
		if tx != nil {
			_ = tx.Rollback(cctx)
		}
		if lost {
			return p.leaseLost(herr)
		}
		return p.handlerFailed(delivery, errors.Join(herr, p.release(ctx, key, token)))
	}
	resp := &idem.Response{Status: 200, Body: result}
	now := p.cfg.NowFunc()
	if tx == nil {
		err := p.store.Complete(cctx, p.scope, key, token, resp, now, now.Add(p.cfg.TTL))
		switch {
		case err == nil:
			return Outcome{Action: Ack, Reason: Executed, Result: result}
		case errors.Is(err, idem.ErrLockLost):
			// The effects happened; another delivery took the key over and will run
			// too. A store without transactions cannot prevent that: acknowledge.
			return Outcome{Action: Ack, Reason: LeaseLost, Result: result, Err: err}
		default:
			return Outcome{Action: Ack, Reason: StoreFailed, Result: result, Err: fmt.Errorf("consumer %s: the handler ran but its record could not be stored (a redelivery after the lease may run it again): %w", p.cfg.Name, err)}
		}
	}
	if hctx.Err() != nil {
		// HandlerTimeout passed or the lease was lost while the handler ran: its
		// transaction ends with its context on every store, whether or not the
		// store noticed in time.
		_ = tx.Rollback(cctx)
		if lost {
			return p.leaseLost(context.Cause(hctx))
		}
		return p.handlerFailed(delivery, errors.Join(fmt.Errorf("consumer %s: the handler ran past HandlerTimeout (%v), so its transaction was rolled back and nothing was committed: %w", p.cfg.Name, p.cfg.HandlerTimeout, context.Cause(hctx)), p.release(ctx, key, token)))
	}
	err := tx.Complete(cctx, p.scope, key, token, resp, now, now.Add(p.cfg.TTL))
	committing := err == nil
	if committing {
		err = tx.Commit(cctx)
	}
	if err == nil {
		return Outcome{Action: Ack, Reason: Executed, Result: result}
	}
	_ = tx.Rollback(cctx)
	switch {
	case errors.Is(err, idem.ErrLockLost) || lost:
		return p.leaseLost(err)
	case errors.Is(err, idem.ErrTxAborted):
		// The database rolled the transaction back: nothing committed; retry as a
		// failed delivery.
		return p.handlerFailed(delivery, errors.Join(err, p.release(ctx, key, token)))
	case !committing:
		return p.storeFailed(delivery, errors.Join(fmt.Errorf("complete: %w", err), p.release(ctx, key, token)))
	default:
		// The commit's outcome is unknown. If it went through, the record is
		// complete, the release below changes nothing, and the redelivery is acked
		// as a duplicate; if not, the redelivery runs afresh.
		return p.storeFailed(delivery, errors.Join(fmt.Errorf("commit (outcome unknown): %w", err), p.release(ctx, key, token)))
	}
}

func (p *Processor) leaseLost(err error) Outcome {
	return Outcome{Action: Retry, Reason: LeaseLost, Delay: 10 * time.Millisecond, Err: fmt.Errorf("consumer %s: the lease lapsed and another delivery took the message over; nothing was committed: %w", p.cfg.Name, err)}
}

// renew extends the lease every Lease/3 until the returned stop is called; when
// the lease turns out to be lost it cancels the handler's context with cause
// idem.ErrLockLost. Transient store errors are not a lost lease: the fenced
// completion has the last word.
func (p *Processor) renew(ctx context.Context, cancel context.CancelCauseFunc, key, token string) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(p.cfg.Lease / 3)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			ectx, c := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.Lease/3)
			at := p.cfg.NowFunc()
			err := p.store.Extend(ectx, p.scope, key, token, at, at.Add(p.cfg.Lease))
			c()
			if errors.Is(err, idem.ErrLockLost) {
				cancel(idem.ErrLockLost)
				return
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() { close(done); wg.Wait() })
	}
}
