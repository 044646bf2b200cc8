// Package consumer gives message consumers the guarantee idem gives HTTP
// handlers: a broker delivers at least once, and the handler's effects happen
// once per message ID.
//
// A Processor runs one delivered message under a dedupe key through an
// idem.Store, with the same record states as an HTTP request: an atomic claim,
// a fenced lease renewed while the handler runs, a takeover when the holder
// crashed, the TTL and the janitor. The scope is the consumer's name, and the
// per-message tenant when Config.Scope names one, stored in a namespace of its
// own that no HTTP scope can take (see StoredScope); two consumers of one
// stream dedupe independently. The key is the message ID the producer set
// (JetStream's Nats-Msg-Id, AMQP's message_id, or a header you name), never a
// hash of the body; the fingerprint is a hash of the payload (and of the
// headers in Config.FingerprintHeaders), so that one ID sent with two payloads
// is reported instead of silently skipped.
//
// Attempts are counted where they survive a crash: a delivery that takes a
// lapsed claim over (its holder crashed or stalled) and a delivery whose
// handler failed each leave an attempt marker in the store, so MaxDeliveries
// holds on every transport, also where the broker counts nothing.
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
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
)

// Message is one delivery of a message, as an adapter hands it to Process.
type Message struct {
	// ID is the producer-set message ID: the dedupe key. Any 1 to 255 bytes of
	// visible ASCII (a UUID, a ULID, "order-42", "<id@host>", padded base64…)
	// is used as it is; a longer ID of visible ASCII, or one that starts with
	// "sha256:", is keyed by its digest ("sha256:" and 64 hex digits, see Key).
	// An empty ID, or one with a space, a control character or a byte outside
	// ASCII, is dead-lettered as InvalidID.
	ID string
	// Payload is the message body; its hash is the record's fingerprint.
	Payload []byte
	// Delivery is the broker's count of this delivery, 1 for the first, counting
	// only deliveries that ran or may have ran the handler. 0 means the broker
	// counts nothing (Watermill): the Processor then reads its own attempt count
	// from the store on every delivery. The attempt number MaxDeliveries bounds
	// is the larger of Delivery and the store's count. Process sets Delivery to
	// that attempt number once it has claimed the message (before the handler
	// runs).
	Delivery int
	// Header holds the message's headers, for the handler and Config.Scope; only
	// the ones named in Config.FingerprintHeaders are part of the fingerprint.
	Header map[string][]string

	// held is the token of the last claim Process made for this delivery. If
	// the store failed and the key could not be released, the next Process of
	// the same *Message (an adapter retrying in process) finds its own claim
	// and takes it back, instead of waiting out the lease and counting the
	// takeover as an attempt.
	held string
}

// HeldClaim returns the token of the claim Process last made for this
// delivery, "" if none. An adapter that retries a message through a copy
// (consumer/amqp) carries it over to the copy with ResumeClaim, so that a
// claim a store failure left behind is taken back instead of waited out.
func (m *Message) HeldClaim() string { return m.held }

// ResumeClaim tells Process that token is the claim an earlier delivery of
// this message made and left in flight when the store failed (HeldClaim of
// that delivery). If the record is still in flight under that token, Process
// gives it back and claims the message again, spending no attempt; any other
// token changes nothing.
func (m *Message) ResumeClaim(token string) { m.held = token }

// Handler processes one message. With a transactional store it writes through
// the transaction in ctx (for example sqlitestore.Tx(ctx)) and must not commit
// it. The result, if any, is stored with the record and returned as
// Outcome.Result for every later duplicate (for request-reply). An error
// rolls the transaction back and frees the key; wrap it with Permanent to
// dead-letter the message at once instead of retrying it.
//
// ctx carries the message's steps: idem.Step(ctx, name, fn) records a call
// to another service so that a redelivery (after a crash, a failed handler,
// a takeover) returns its recorded result instead of calling again, with a
// derived key for the call's Idempotency-Key (docs/effects.md). A step's
// final failure (idem.ErrStepFailed) and a step refused as unknown
// (idem.ErrStepUnknown), returned by the handler, dead-letter the message at
// once.
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
	// InvalidID: the message has no usable ID, or Config.Scope panicked on it
	// (DeadLetter).
	InvalidID
	// StoreFailed: the store failed, or the context given to Process ended
	// before the message was claimed (Retry after Backoff; not a failed
	// delivery).
	// Outcome.Err says which of three cases it was: nothing was committed (the
	// claim or the transaction could not start); the commit's outcome is unknown
	// (the store did not answer it nor a read-back; the redelivery finds out:
	// acked as a duplicate if it committed, run afresh if not); or, with a store
	// without transactions, the handler's effects happened but the record could
	// not be written (Ack, so they do not happen twice).
	StoreFailed
	// LeaseLost: the lease lapsed and another delivery took the key over (Retry:
	// the redelivery finds the other's outcome). With a transactional store
	// nothing this delivery did was committed. With a store without
	// transactions (redisstore, memstore) its effects did happen, and so do
	// those of the delivery that took over: two runs of one message, the one
	// case those stores cannot prevent (keep Lease above the longest handler).
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
	// different names dedupe independently. Required. Its records are stored in
	// the consumers' namespace (StoredScope), never in an HTTP tenant's scope.
	Name string
	// Scope, when set, returns the tenant of a message (a header, a subject
	// token, a routing key): messages of different tenants dedupe
	// independently, so that two tenants' message "o-1" are two messages. The
	// tenant is part of the record's scope and of its fingerprint. List the
	// headers it reads in FingerprintHeaders. "" is the consumer's own scope,
	// the one without Scope. A message it panics on is dead-lettered unrun
	// (InvalidID), not a crash of the consumer. Default: one scope per
	// consumer.
	Scope func(msg *Message) string
	// FingerprintHeaders names the headers that are part of the fingerprint,
	// besides the payload: the ones Scope and the handler read (a tenant
	// header). One ID sent again with another value in one of them is then
	// dead-lettered as a Mismatch instead of acked as a duplicate. Default none.
	FingerprintHeaders []string
	// LegacyScope, when true, also honours records written by versions before
	// the consumers' namespace (scope = the bare Name, shared with HTTP): a
	// message that has no record in the namespace but a complete one there,
	// with the same payload fingerprint (the payload's hash, as earlier
	// versions had it, whatever FingerprintHeaders says), is acked as a
	// duplicate without running; one in flight there is retried while its
	// lease lasts, and run once it lapsed (its claim taken over). Only messages
	// whose tenant is "" are looked up: a tenant's message never takes
	// another's old record for its own. It costs one read per message:
	// turn it on for one TTL after upgrading, then off. Default false.
	LegacyScope bool
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

// The consumers' namespace. Every stored form of an HTTP scope (idem.StoredScope)
// is either printable text that does not start with "sha256:" or "sha256:" and
// 64 hexadecimal digits; a consumer's stored scope starts with "sha256:" and
// goes on with a letter that is not a hex digit ("sha256:consumer:…"), so no
// HTTP scope can ever take it.
const (
	nsPrefix       = "sha256:consumer:"
	nsDigestPrefix = "sha256:consumer-digest:"
	attemptsPrefix = "sha256:consumer-attempts:"
	attemptsDigest = "sha256:consumer-attempts-digest:"
)

// StoredScope returns the scope under which a consumer named name keeps the
// records of tenant's messages (tenant "" without Config.Scope):
// "sha256:consumer:" + name, followed by "/" + tenant when there is one. A name
// with a "/", a form longer than idem.MaxStoredScopeLength or one that is not
// printable is stored as "sha256:consumer-digest:" and the hex SHA-256 of the
// two. It is the form to give tools that read records by their stored scope.
// No HTTP scope is ever stored in this form (see the package doc).
func StoredScope(name, tenant string) string {
	return nsScope(nsPrefix, nsDigestPrefix, name, tenant)
}

func nsScope(prefix, digestPrefix, name, tenant string) string {
	s := prefix + name
	if tenant != "" {
		s += "/" + tenant
	}
	if len(s) <= idem.MaxStoredScopeLength && idem.StoredScope(name) == name && (tenant == "" || idem.StoredScope(tenant) == tenant) && !containsSlash(name) {
		return s
	}
	h := sha256.New()
	fmt.Fprintf(h, "%d:%s%s", len(name), name, tenant)
	return digestPrefix + hex.EncodeToString(h.Sum(nil))
}

func containsSlash(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == '/' {
			return true
		}
	}
	return false
}

// keyDigestPrefix starts a key stored as a digest.
const keyDigestPrefix = "sha256:"

// Key returns the dedupe key of a message ID, and false when the ID is not
// usable: the ID itself when it is 1 to 255 bytes of visible ASCII (0x21 to
// 0x7e) and does not start with "sha256:"; "sha256:" and the hex SHA-256 of
// the ID when it is longer, or starts with "sha256:" (so that two IDs never
// share a key); false when it is empty or holds any other byte.
func Key(id string) (string, bool) {
	if id == "" {
		return "", false
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c < 0x21 || c > 0x7e {
			return "", false
		}
	}
	if len(id) <= idem.DefaultMaxKeyLength && (len(id) < len(keyDigestPrefix) || id[:len(keyDigestPrefix)] != keyDigestPrefix) {
		return id, true
	}
	sum := sha256.Sum256([]byte(id))
	return keyDigestPrefix + hex.EncodeToString(sum[:]), true
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
	scope   string // the stored scope without a tenant
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
	cfg.FingerprintHeaders = append([]string(nil), cfg.FingerprintHeaders...)
	sort.Strings(cfg.FingerprintHeaders)
	p := &Processor{cfg: cfg, scope: StoredScope(cfg.Name, ""), store: store}
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
// instead of being retried. Permanent(nil) is nil. A handler may also panic
// with it.
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

// Fingerprint is the fingerprint of a payload: "m1:" and its hex SHA-256. It
// is the record's fingerprint when neither Config.Scope nor
// Config.FingerprintHeaders is set.
func Fingerprint(payload []byte) string {
	sum := sha256.Sum256(payload)
	return "m1:" + hex.EncodeToString(sum[:])
}

// fingerprint is "m1:" (payload only) or "m2:" and the hex SHA-256 of the
// payload, the tenant and the FingerprintHeaders, each length-prefixed.
func (p *Processor) fingerprint(msg *Message, tenant string) string {
	if p.cfg.Scope == nil && len(p.cfg.FingerprintHeaders) == 0 {
		return Fingerprint(msg.Payload)
	}
	h := sha256.New()
	fmt.Fprintf(h, "%d:", len(msg.Payload))
	h.Write(msg.Payload)
	fmt.Fprintf(h, "%d:%s", len(tenant), tenant)
	for _, name := range p.cfg.FingerprintHeaders {
		vs := headerValues(msg.Header, name)
		fmt.Fprintf(h, "%d:%s%d", len(name), name, len(vs))
		for _, v := range vs {
			fmt.Fprintf(h, "%d:%s", len(v), v)
		}
	}
	return "m2:" + hex.EncodeToString(h.Sum(nil))
}

// headerValues reads a header by its exact name, else case-insensitively:
// the values of every header whose name matches, in the order of the names
// (never the map's order, which would change the fingerprint between two
// deliveries of one message).
func headerValues(h map[string][]string, name string) []string {
	if vs, ok := h[name]; ok {
		return vs
	}
	var keys []string
	for k := range h {
		if strings.EqualFold(k, name) {
			keys = append(keys, k)
		}
	}
	if len(keys) == 1 {
		return h[keys[0]]
	}
	sort.Strings(keys)
	var vs []string
	for _, k := range keys {
		vs = append(vs, h[k]...)
	}
	return vs
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

// run is one claimed delivery.
type run struct {
	scope, key, token string
	attempt           int
	tenant            string
	expires           time.Time // the claim's expiry: the steps' (idem.Step)
	takeover          bool      // the claim took a lapsed one over
}

func (p *Processor) process(ctx context.Context, msg *Message, h Handler) Outcome {
	if msg == nil {
		return Outcome{Action: DeadLetter, Reason: InvalidID, Err: fmt.Errorf("consumer %s: Process was given a nil *Message", p.cfg.Name)}
	}
	if h == nil {
		// Nothing is claimed: the message is retried, untouched, until the
		// program is fixed.
		return Outcome{Action: Retry, Reason: Failed, Delay: p.cfg.Backoff(1), Err: fmt.Errorf("consumer %s: Process was given a nil Handler; pass the function that processes the message", p.cfg.Name)}
	}
	key, ok := Key(msg.ID)
	if !ok {
		return Outcome{Action: DeadLetter, Reason: InvalidID, Err: fmt.Errorf("consumer %s: the message has no usable ID (%s); producers must give every message an ID of visible ASCII characters, without spaces (a UUID, \"order-42\"; one longer than 255 bytes is keyed by its digest), in Nats-Msg-Id, AMQP message_id or the key header, and keep it across retries", p.cfg.Name, describeID(msg.ID))}
	}
	tenant, err := p.tenantOf(msg)
	if err != nil {
		return Outcome{Action: DeadLetter, Reason: InvalidID, Err: err}
	}
	r := run{scope: p.scope, key: key, token: newToken(), tenant: tenant}
	if tenant != "" {
		r.scope = StoredScope(p.cfg.Name, tenant)
	}
	now := p.cfg.NowFunc()
	claim := idem.ClaimRequest{
		Scope: r.scope, Key: key, Fingerprint: p.fingerprint(msg, tenant), Token: r.token,
		Now: now, LeaseUntil: now.Add(p.cfg.Lease), ExpiresAt: now.Add(p.cfg.TTL),
	}
	rec, claimed, err := p.store.Claim(ctx, claim)
	if err == nil && !claimed && msg.held != "" && rec.State != idem.StateComplete && rec.Token == msg.held {
		// This delivery's own claim, left by a store failure that also failed
		// its release: give it back and claim again (no attempt was made).
		if err = p.store.Release(ctx, claim.Scope, claim.Key, msg.held); err == nil || errors.Is(err, idem.ErrLockLost) {
			rec, claimed, err = p.store.Claim(ctx, claim)
		}
	}
	if err != nil {
		if cerr := ctx.Err(); cerr != nil {
			// Not the store's fault: the caller gave up (the consumer is stopping).
			return Outcome{Action: Retry, Reason: StoreFailed, Delay: p.cfg.Backoff(max(msg.Delivery, 1)), Err: fmt.Errorf("consumer %s: the context ended (%v) before message %q was claimed, so nothing ran and nothing was committed; the message will be redelivered: %w", p.cfg.Name, context.Cause(ctx), msg.ID, err)}
		}
		return p.storeFailed(max(msg.Delivery, 1), fmt.Errorf("claim: %w", err))
	}
	if claimed {
		msg.held = r.token
		r.expires = claim.ExpiresAt
	}
	if !claimed {
		return p.notClaimed(ctx, msg, rec, claim)
	}
	// Count the attempt. A takeover means the claim's earlier holder crashed or
	// stalled: that attempt did not finish, and is marked as one.
	delivery := max(msg.Delivery, 1)
	// Stores keep CreatedAt across a takeover, to their precision (a
	// microsecond, a millisecond); a lease lapses at least Lease after it.
	takeover := rec != nil && rec.CreatedAt.Before(now.Add(-p.cfg.Lease/2))
	r.takeover = takeover
	var n int
	switch {
	case takeover:
		n, err = p.markAttempt(ctx, r, now)
	case msg.Delivery != 1:
		n, err = p.countAttempts(ctx, r, now)
	}
	if err != nil {
		return p.storeFailed(delivery, errors.Join(fmt.Errorf("count attempts: %w", err), p.release(ctx, r)))
	}
	r.attempt = max(delivery, n+1)
	msg.Delivery = r.attempt
	if p.cfg.LegacyScope {
		if out, done := p.legacy(ctx, msg, r, claim); done {
			return out
		}
	}
	if r.attempt > p.cfg.MaxDeliveries {
		// Past the limit without a stored outcome: every earlier attempt failed or
		// crashed its consumer. Give the key up and dead-letter the message.
		err := p.release(ctx, r)
		return Outcome{Action: DeadLetter, Reason: Poison, Err: errors.Join(fmt.Errorf("consumer %s: message %q came for attempt %d, past MaxDeliveries (%d), without being processed (earlier attempts failed or crashed their consumer); the handler did not run", p.cfg.Name, msg.ID, r.attempt, p.cfg.MaxDeliveries), err)}
	}
	return p.execute(ctx, msg, r, h)
}

// tenantOf runs Config.Scope. A panic in the hook is an error, not the
// consumer's crash: a redelivery would crash every process it reaches, forever.
func (p *Processor) tenantOf(msg *Message) (tenant string, err error) {
	if p.cfg.Scope == nil {
		return "", nil
	}
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("consumer %s: Config.Scope panicked on message %q, so it has no tenant to be deduplicated under; the handler did not run (make the hook return a tenant, or \"\" for none, for every message): %v", p.cfg.Name, msg.ID, v)
		}
	}()
	return p.cfg.Scope(msg), nil
}

func describeID(id string) string {
	if id == "" {
		return "it is empty"
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; c < 0x21 || c > 0x7e {
			return fmt.Sprintf("%q holds the byte %#02x at offset %d, outside visible ASCII", id, c, i)
		}
	}
	return fmt.Sprintf("%q", id)
}

func (p *Processor) notClaimed(ctx context.Context, msg *Message, rec *idem.Record, claim idem.ClaimRequest) Outcome {
	// A record written before Scope or FingerprintHeaders were set has the
	// payload-only fingerprint: for the consumer's own scope that is the same
	// message, not a mismatch (it was processed, or is in flight, under the
	// configuration of that moment).
	before := rec.Fingerprint != claim.Fingerprint && rec.Fingerprint == Fingerprint(msg.Payload)
	switch {
	case before && rec.State != idem.StateComplete && !rec.LeaseUntil.After(claim.Now):
		// Its holder crashed; the store takes a claim over only under the same
		// fingerprint, so give the lapsed claim up (fenced by its token) and let
		// the redelivery claim the message afresh.
		cctx, cancel := p.cleanup(ctx)
		defer cancel()
		err := p.store.Release(cctx, claim.Scope, claim.Key, rec.Token)
		if errors.Is(err, idem.ErrLockLost) {
			err = nil
		}
		return Outcome{Action: Retry, Reason: InFlight, Delay: 10 * time.Millisecond, Err: err}
	case rec.Fingerprint != claim.Fingerprint && !before:
		return Outcome{Action: DeadLetter, Reason: Mismatch, Err: fmt.Errorf("consumer %s: message %q was first processed with a different payload or fingerprinted headers (a %s record); the handler did not run; a message ID names one message, so the producer must give a new message a new ID", p.cfg.Name, msg.ID, rec.State)}
	case rec.State == idem.StateComplete:
		var result []byte
		if rec.Response != nil {
			result = rec.Response.Body
		}
		return Outcome{Action: Ack, Reason: Duplicate, Result: result}
	default:
		left := rec.LeaseUntil.Sub(claim.Now)
		return Outcome{Action: Retry, Reason: InFlight, Delay: max(left, 10*time.Millisecond)}
	}
}

// legacy looks the message up under the scope of versions before the
// consumers' namespace (Config.LegacyScope).
func (p *Processor) legacy(ctx context.Context, msg *Message, r run, claim idem.ClaimRequest) (Outcome, bool) {
	if r.tenant != "" {
		return Outcome{}, false // earlier versions had no tenants
	}
	rec, err := p.store.Get(ctx, idem.StoredScope(p.cfg.Name), r.key, claim.Now)
	switch {
	case errors.Is(err, idem.ErrNotFound):
		return Outcome{}, false
	case err != nil:
		return p.storeFailed(r.attempt, errors.Join(fmt.Errorf("read the legacy record: %w", err), p.release(ctx, r))), true
	case rec.Fingerprint != Fingerprint(msg.Payload):
		// Not this message's record: an HTTP request's (its fingerprint is "v1:…"),
		// or another payload. The namespace decides. (Earlier versions
		// fingerprinted the payload only, whatever FingerprintHeaders says now.)
		return Outcome{}, false
	case rec.State == idem.StateComplete:
		var result []byte
		if rec.Response != nil {
			result = rec.Response.Body
		}
		cctx, cancel := p.cleanup(ctx)
		defer cancel()
		now := p.cfg.NowFunc()
		if err := p.store.Complete(cctx, r.scope, r.key, r.token, &idem.Response{Status: 200, Body: result}, now, rec.ExpiresAt); err != nil {
			_ = p.release(ctx, r)
		}
		return Outcome{Action: Ack, Reason: Duplicate, Result: result}, true
	case !rec.LeaseUntil.After(claim.Now):
		// In flight under an earlier version whose lease lapsed: that process
		// crashed or was stopped for the upgrade. Take its claim over, so that a
		// late completion of it is fenced out, drop it, and run the message
		// under the namespace; else it would wait for that record's TTL.
		legacyScope := idem.StoredScope(p.cfg.Name)
		_, took, err := p.store.Claim(ctx, idem.ClaimRequest{Scope: legacyScope, Key: r.key, Fingerprint: rec.Fingerprint, Token: r.token,
			Now: claim.Now, LeaseUntil: claim.Now.Add(p.cfg.Lease), ExpiresAt: rec.ExpiresAt})
		if err == nil && took {
			cctx, cancel := p.cleanup(ctx)
			err = p.store.Release(cctx, legacyScope, r.key, r.token)
			cancel()
			if err == nil || errors.Is(err, idem.ErrLockLost) {
				return Outcome{}, false
			}
		}
		if err != nil {
			return p.storeFailed(r.attempt, errors.Join(fmt.Errorf("take over the legacy record: %w", err), p.release(ctx, r))), true
		}
		fallthrough
	default:
		err := p.release(ctx, r)
		return Outcome{Action: Retry, Reason: InFlight, Delay: max(rec.LeaseUntil.Sub(claim.Now), 10*time.Millisecond), Err: err}, true
	}
}

// Attempt markers: one record per unfinished attempt, under the attempts
// namespace, keyed "<key>#<n>". They are claimed with a lease as long as their
// TTL, so nothing ever takes them over, and the janitor deletes them with the
// other expired records.
func (p *Processor) markerScope(r run) string {
	return nsScope(attemptsPrefix, attemptsDigest, p.cfg.Name, r.tenant)
}

func markerKey(key string, n int) string {
	suffix := "#" + strconv.Itoa(n)
	if len(key)+len(suffix) > idem.DefaultMaxKeyLength {
		// Keys longer than 255 bytes are refused by stores that index 255
		// (mysqlstore) and truncated by others.
		sum := sha256.Sum256([]byte(key))
		key = keyDigestPrefix + hex.EncodeToString(sum[:])
	}
	return key + suffix
}

// markAttempt adds a marker and returns how many there are.
func (p *Processor) markAttempt(ctx context.Context, r run, now time.Time) (int, error) {
	cctx, cancel := p.cleanup(ctx)
	defer cancel()
	scope := p.markerScope(r)
	for n := 1; ; n++ {
		_, claimed, err := p.store.Claim(cctx, idem.ClaimRequest{
			Scope: scope, Key: markerKey(r.key, n), Fingerprint: "m1:attempt", Token: newToken(),
			Now: now, LeaseUntil: now.Add(p.cfg.TTL), ExpiresAt: now.Add(p.cfg.TTL),
		})
		if err != nil {
			return 0, err
		}
		if claimed || n > p.cfg.MaxDeliveries {
			return n, nil
		}
	}
}

// fillAttempts makes sure there are MaxDeliveries markers.
func (p *Processor) fillAttempts(ctx context.Context, r run, now time.Time) error {
	cctx, cancel := p.cleanup(ctx)
	defer cancel()
	scope := p.markerScope(r)
	for n := 1; n <= p.cfg.MaxDeliveries; n++ {
		if _, _, err := p.store.Claim(cctx, idem.ClaimRequest{
			Scope: scope, Key: markerKey(r.key, n), Fingerprint: "m1:attempt", Token: newToken(),
			Now: now, LeaseUntil: now.Add(p.cfg.TTL), ExpiresAt: now.Add(p.cfg.TTL),
		}); err != nil {
			return err
		}
	}
	return nil
}

// countAttempts returns how many markers there are.
func (p *Processor) countAttempts(ctx context.Context, r run, now time.Time) (int, error) {
	scope := p.markerScope(r)
	for n := 1; n <= p.cfg.MaxDeliveries+1; n++ {
		_, err := p.store.Get(ctx, scope, markerKey(r.key, n), now)
		if errors.Is(err, idem.ErrNotFound) {
			return n - 1, nil
		}
		if err != nil {
			return 0, err
		}
	}
	return p.cfg.MaxDeliveries + 1, nil
}

// DeadLettered tells the Processor that the adapter has put msg, dead-lettered
// with out, in its dead-letter destination. For a Poison outcome it deletes
// the message's attempt markers, so that the message, republished from there,
// gets its MaxDeliveries again (until then a redelivery is dead-lettered
// again without running); for other reasons it does nothing, so that a
// mismatched copy never resets the attempts of the message whose ID it
// reuses. Adapters call it; an error only means the markers stay until their
// TTL.
func (p *Processor) DeadLettered(ctx context.Context, msg *Message, out Outcome) error {
	if out.Reason != Poison {
		return nil
	}
	key, ok := Key(msg.ID)
	if !ok {
		return nil
	}
	tenant, err := p.tenantOf(msg)
	if err != nil {
		return nil // no attempt was marked under a tenant the hook cannot name
	}
	r := run{key: key, tenant: tenant}
	cctx, cancel := p.cleanup(ctx)
	defer cancel()
	scope := p.markerScope(r)
	now := p.cfg.NowFunc()
	for n := 1; n <= p.cfg.MaxDeliveries+1; n++ {
		rec, err := p.store.Get(cctx, scope, markerKey(key, n), now)
		if errors.Is(err, idem.ErrNotFound) {
			return nil
		}
		if err == nil {
			err = p.store.Release(cctx, scope, markerKey(key, n), rec.Token)
		}
		if err != nil && !errors.Is(err, idem.ErrLockLost) {
			return fmt.Errorf("consumer %s: delete the attempt markers of message %q (they expire with the TTL): %w", p.cfg.Name, msg.ID, err)
		}
	}
	return nil
}

// storeFailed is the outcome of a store failure before anything committed.
func (p *Processor) storeFailed(delivery int, err error) Outcome {
	return Outcome{Action: Retry, Reason: StoreFailed, Delay: p.cfg.Backoff(delivery), Err: fmt.Errorf("consumer %s: the idempotency store failed before anything was committed; the message will be redelivered: %w", p.cfg.Name, err)}
}

// failed is the outcome of an attempt that ran the handler and committed
// nothing: it is marked as an attempt, the key is released, and the message is
// retried or, at MaxDeliveries or when err is Permanent, dead-lettered.
func (p *Processor) failed(ctx context.Context, r run, err error) Outcome {
	// A step that failed for good fails the same way on every redelivery, and
	// one refused as unknown stays so until an operator settles it: both are
	// dead-lettered at once.
	poison := IsPermanent(err) || r.attempt >= p.cfg.MaxDeliveries ||
		errors.Is(err, idem.ErrStepFailed) || errors.Is(err, idem.ErrStepUnknown)
	var merr error
	if poison {
		// Until the adapter has the message in its dead-letter destination
		// (DeadLettered), a redelivery — its dead-lettering failed — finds the
		// attempts used up and is dead-lettered again without running.
		merr = p.fillAttempts(ctx, r, p.cfg.NowFunc())
	} else {
		_, merr = p.markAttempt(ctx, r, p.cfg.NowFunc())
	}
	if merr != nil {
		merr = fmt.Errorf("mark the attempt (unmarked, it does not count toward MaxDeliveries): %w", merr)
	}
	err = errors.Join(err, merr, p.release(ctx, r))
	if poison {
		return Outcome{Action: DeadLetter, Reason: Poison, Err: err}
	}
	return Outcome{Action: Retry, Reason: Failed, Delay: p.cfg.Backoff(r.attempt), Err: err}
}

func (p *Processor) cleanup(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), p.cfg.CleanupTimeout)
}

// release gives the key up; a key no longer held under token is nothing to undo.
func (p *Processor) release(ctx context.Context, r run) error {
	cctx, cancel := p.cleanup(ctx)
	defer cancel()
	err := p.store.Release(cctx, r.scope, r.key, r.token)
	if errors.Is(err, idem.ErrLockLost) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("release (the key stays claimed until its lease lapses): %w", err)
	}
	return nil
}

// execute runs the handler of a claimed message and settles its outcome.
func (p *Processor) execute(ctx context.Context, msg *Message, r run, h Handler) (out Outcome) {
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
			return p.storeFailed(r.attempt, errors.Join(fmt.Errorf("begin transaction: %w", err), p.release(ctx, r)))
		}
	}
	// The handler's steps (idem.Step) are this claim's: fenced on its token,
	// expiring with its record.
	runCtx = idem.WithSteps(runCtx, idem.StepOperation{
		Store: p.store, Scope: r.scope, Key: r.key, Owner: r.token, Holder: true,
		ExpiresAt: r.expires, NowFunc: p.cfg.NowFunc, CleanupTimeout: p.cfg.CleanupTimeout,
		TakenOver: r.takeover,
	})
	renew := p.renew(hctx, cancel, r)
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
		perr := fmt.Errorf("consumer %s: the handler panicked: %v", p.cfg.Name, v)
		if e, ok := v.(error); ok {
			perr = fmt.Errorf("consumer %s: the handler panicked: %w", p.cfg.Name, e)
		}
		out = p.failed(ctx, r, perr)
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
			return p.leaseLost(herr, tx != nil)
		}
		return p.failed(ctx, r, herr)
	}
	resp := &idem.Response{Status: 200, Body: result}
	now := p.cfg.NowFunc()
	if tx == nil {
		err := p.store.Complete(cctx, r.scope, r.key, r.token, resp, now, now.Add(p.cfg.TTL))
		switch {
		case err == nil:
			return Outcome{Action: Ack, Reason: Executed, Result: result}
		case errors.Is(err, idem.ErrLockLost):
			// The effects happened; another delivery took the key over and will run
			// too. A store without transactions cannot prevent that: acknowledge.
			return Outcome{Action: Ack, Reason: LeaseLost, Result: result, Err: fmt.Errorf("consumer %s: the lease lapsed while the handler ran and another delivery took the message over; this run's effects happened, and the other's happen too (a store without transactions cannot prevent it; keep Lease above the longest handler): %w", p.cfg.Name, err)}
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
			return p.leaseLost(context.Cause(hctx), true)
		}
		return p.failed(ctx, r, fmt.Errorf("consumer %s: the handler ran past HandlerTimeout (%v), so its transaction was rolled back and nothing was committed: %w", p.cfg.Name, p.cfg.HandlerTimeout, context.Cause(hctx)))
	}
	err := tx.Complete(cctx, r.scope, r.key, r.token, resp, now, now.Add(p.cfg.TTL))
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
		return p.leaseLost(err, true)
	case errors.Is(err, idem.ErrTxAborted):
		// The database refused the transaction: nothing committed, and it may
		// refuse it every time (a deferred constraint): a failed delivery.
		return p.failed(ctx, r, fmt.Errorf("consumer %s: the database refused the handler's transaction, nothing was committed: %w", p.cfg.Name, err))
	case !committing:
		return p.storeFailed(r.attempt, errors.Join(fmt.Errorf("complete: %w", err), p.release(ctx, r)))
	}
	return p.commitFailed(ctx, r, err)
}

// commitFailed settles a commit that returned an error other than
// ErrTxAborted: it reads the record back to learn whether the commit went
// through.
func (p *Processor) commitFailed(ctx context.Context, r run, cerr error) Outcome {
	cctx, stop := p.cleanup(ctx)
	defer stop()
	rec, err := p.store.Get(cctx, r.scope, r.key, p.cfg.NowFunc())
	switch {
	case err == nil && rec.State == idem.StateComplete:
		// It committed; only its answer was lost.
		var result []byte
		if rec.Response != nil {
			result = rec.Response.Body
		}
		return Outcome{Action: Ack, Reason: Executed, Result: result}
	case err == nil && rec.Token == r.token:
		// Still in flight under this claim: the commit did not happen. The
		// handler ran and its work was refused or lost: a failed delivery, so that
		// a commit the database always refuses ends in the dead-letter
		// destination, not in a loop.
		return p.failed(ctx, r, fmt.Errorf("consumer %s: the commit failed and nothing was committed (the record is still in flight under this delivery's claim): %w", p.cfg.Name, cerr))
	case err == nil || errors.Is(err, idem.ErrNotFound):
		return p.leaseLost(cerr, true)
	default:
		// If it committed, the record is complete and the fenced release changes
		// nothing; if not, the redelivery runs afresh.
		return Outcome{Action: Retry, Reason: StoreFailed, Delay: p.cfg.Backoff(r.attempt), Err: fmt.Errorf("consumer %s: the commit's outcome is unknown (the store answered neither the commit nor a read-back); the redelivery finds out: acked as a duplicate if it committed, run again if not: %w", p.cfg.Name, errors.Join(cerr, err, p.release(ctx, r)))}
	}
}

func (p *Processor) leaseLost(err error, tx bool) Outcome {
	what := "nothing this delivery did was committed"
	if !tx {
		what = "with a store without transactions its effects happened, and the other delivery's happen too"
	}
	return Outcome{Action: Retry, Reason: LeaseLost, Delay: 10 * time.Millisecond, Err: fmt.Errorf("consumer %s: the lease lapsed and another delivery took the message over; %s: %w", p.cfg.Name, what, err)}
}

// renew extends the lease every Lease/3 until the returned stop is called; when
// the lease turns out to be lost it cancels the handler's context with cause
// idem.ErrLockLost. Transient store errors are not a lost lease: the fenced
// completion has the last word. stop ends a renewal call in progress instead of
// waiting for it: with SQLite that call waits for the write lock the handler's
// own transaction holds until it commits, which comes after stop.
func (p *Processor) renew(ctx context.Context, cancel context.CancelCauseFunc, r run) (stop func()) {
	rctx, end := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(p.cfg.Lease / 3)
		defer t.Stop()
		for {
			select {
			case <-rctx.Done():
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			ectx, c := context.WithTimeout(rctx, p.cfg.Lease/3)
			at := p.cfg.NowFunc()
			err := p.store.Extend(ectx, r.scope, r.key, r.token, at, at.Add(p.cfg.Lease))
			c()
			if errors.Is(err, idem.ErrLockLost) {
				cancel(idem.ErrLockLost)
				return
			}
		}
	}()
	var once sync.Once
	return func() {
		once.Do(func() { end(); wg.Wait() })
	}
}
