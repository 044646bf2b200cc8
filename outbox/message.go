package outbox

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/eventseq"
)

// Message is an event to publish, as a handler enqueues it.
type Message struct {
	// ID is the message's identity, the same for every publication of it: the
	// broker's and the consumer's dedupe key (Nats-Msg-Id, AMQP message-id,
	// Watermill UUID). Leave it empty in a handler that idem is executing:
	// Enqueue sets it to MessageID(scope, key, Name) (see Name for a second
	// message of the same Name). Outside one (a job, a
	// script) it must be given. It is 1 to 255 bytes of visible ASCII.
	ID string
	// Name tells the events of one request apart ("order.created",
	// "invoice.issued"); with the request's scope and key it makes the default
	// ID. Messages of one request that share a Name are numbered in the order
	// they are enqueued: the first gets MessageID(scope, key, Name), the n-th
	// NthMessageID(scope, key, Name, n), the same on every attempt that
	// enqueues them in the same order. Every Enqueue of the Name that passed
	// its checks counts, one rolled back with a savepoint too: a handler that
	// rolls back to a savepoint and enqueues the Name again gives the message
	// that commits the next number, not the first's ID.
	Name string
	// Subject is where the publisher sends it: the NATS subject, the AMQP
	// routing key, the Watermill topic. 1 to 255 bytes of printable UTF-8
	// without spaces.
	Subject string
	// Payload is the message body, at most the store's MaxPayload bytes
	// (DefaultMaxPayload unless configured).
	Payload []byte
	// Headers go with the message as NATS headers, AMQP headers or Watermill
	// metadata. Names are HTTP tokens (letters, digits and !#$%&'*+-.^_`|~),
	// at most 255 bytes, and may not start with "Nats-" (JetStream reads
	// those); values are UTF-8 without control characters, at most
	// MaxHeaderValue bytes; at most MaxHeaders of them, MaxHeaderBytes in all.
	Headers map[string]string
	// PartitionKey orders messages: the relay publishes the messages of one
	// partition one after the other, never one before a message of its
	// partition whose transaction committed before it was enqueued, and the
	// messages of one transaction in the order it enqueued them (those of
	// transactions open at the same time, in either order: docs/outbox.md,
	// "Order within a partition"). Enqueue takes no lock on the partition, so
	// transactions enqueuing into the same partitions never deadlock. It defaults to the request's scope and
	// key (so a request's events keep their order), or to ID outside a
	// request (no order). At most 255 bytes.
	PartitionKey string
}

// Stored is a message as the relay reads it back from the outbox table.
type Stored struct {
	Message
	// Seq is the message's position in the table, taken when it was
	// enqueued: increasing in enqueue order (so a transaction that enqueued
	// earlier and committed later has the lower Seq).
	Seq int64
	// EnqueuedAt is when the transaction that enqueued it wrote it.
	EnqueuedAt time.Time
	// Attempts counts the publications tried before this one.
	Attempts int
}

// DeadLetter is a dead-lettered message as a store's DeadLetters reads it:
// the message, why the relay gave up on it, and when.
type DeadLetter struct {
	Stored
	// Reason is the error that made the message unpublishable.
	Reason string
	// DeadAt is when the relay dead-lettered it.
	DeadAt time.Time
}

// Limits on what Enqueue accepts.
const (
	// DefaultMaxPayload is the largest payload a store's outbox accepts
	// unless configured otherwise: 1 MiB less 20 KiB, so that a message at
	// the bounds, with MaxHeaderBytes of headers and the Nats-Msg-Id, fits
	// NATS's default max_payload of 1 MiB.
	DefaultMaxPayload = 1<<20 - 20<<10
	// MaxIDLength is the longest message ID, the longest a consumer uses as
	// it is.
	MaxIDLength = 255
	// MaxSubjectLength is the longest subject (AMQP's routing-key limit).
	MaxSubjectLength = 255
	// MaxPartitionKeyLength is the longest partition key.
	MaxPartitionKeyLength = 255
	// MaxHeaders is the most headers a message has.
	MaxHeaders = 64
	// MaxHeaderName is the longest header name.
	MaxHeaderName = 255
	// MaxHeaderValue is the longest header value.
	MaxHeaderValue = 4096
	// MaxHeaderBytes bounds the headers' names and values together.
	MaxHeaderBytes = 16 << 10
)

// Errors Prepare (and so every store's Enqueue) returns, wrapped with the
// details.
var (
	// ErrNoID: the message has no ID and ctx is not a request idem executes.
	ErrNoID = errors.New("outbox: message has no ID and the context is not a request idem is executing: set Message.ID (for example outbox.MessageID(scope, key, name) from your own stable identifiers), enqueue inside the handler with the handler's context, or give the context a key with outbox.WithKey")
	// ErrInvalid: a field breaks the rules of Message.
	ErrInvalid = errors.New("outbox: invalid message")
	// ErrTooLarge: the payload is larger than the outbox accepts.
	ErrTooLarge = errors.New("outbox: payload too large")
)

// MessageID returns the ID of the event called name of the request with scope
// and key: the hex SHA-256 of the three, length-prefixed, under a domain
// separator. It is deterministic (the same on every machine and release), so
// every attempt and every publication of one logical event has the same ID,
// and it reveals nothing of the key. 64 characters.
func MessageID(scope, key, name string) string {
	return digest("idem/outbox/message-id/v1", scope, key, name)
}

// NthMessageID returns the ID of the n-th event called name of the request
// with scope and key (n counts from 1): MessageID(scope, key, name) for the
// first, and for a later one the hex SHA-256 of the three and n, under the
// same domain separator. Enqueue gives a request's second "item.added" the
// ID NthMessageID(scope, key, "item.added", 2), so that the broker's and the
// consumer's dedupe do not take it for the first. 64 characters.
func NthMessageID(scope, key, name string, n int) string {
	if n <= 1 {
		return MessageID(scope, key, name)
	}
	return digest("idem/outbox/message-id/v1", scope, key, name, strconv.Itoa(n))
}

// PartitionOf returns the default partition key of the request with scope and
// key (a digest, so that the table does not hold the key in clear).
func PartitionOf(scope, key string) string {
	return digest("idem/outbox/partition/v1", scope, key)
}

func digest(domain string, parts ...string) string {
	h := sha256.New()
	var n [8]byte
	h.Write([]byte(domain))
	for _, p := range parts {
		binary.BigEndian.PutUint64(n[:], uint64(len(p)))
		h.Write(n[:])
		h.Write([]byte(p))
	}
	return hex.EncodeToString(h.Sum(nil))
}

type keyCtx struct {
	scope, key string
	events     *eventseq.Counter
}

type keyCtxKey struct{}

// WithKey returns a context under which Enqueue derives a message's default
// ID and partition from scope and key, as it does in a request idem
// executes: for code that has a stable identity of its own but no idem
// request, such as a consumer's handler (the delivered message's ID as the
// key) or a job (its run's name). idem's own request, if ctx has one, wins.
func WithKey(ctx context.Context, scope, key string) context.Context {
	return context.WithValue(ctx, keyCtxKey{}, keyCtx{scope, key, new(eventseq.Counter)})
}

// keyOf returns the scope and key the defaults derive from, and the counter
// that numbers the messages enqueued under them.
func keyOf(ctx context.Context) (scope, key string, events *eventseq.Counter, ok bool) {
	if scope, key, ok = idem.KeyFrom(ctx); ok {
		return scope, key, eventseq.Lookup(ctx), true
	}
	if v, found := ctx.Value(keyCtxKey{}).(keyCtx); found {
		return v.scope, v.key, v.events, true
	}
	return "", "", nil, false
}

// Prepare checks m and fills in its defaults (ID, PartitionKey) from ctx, the
// way every store's Enqueue does before it writes: maxPayload bounds the
// payload (0 means DefaultMaxPayload). A store's Enqueue calls it; a caller
// may, to check a message early, and should then enqueue the message Prepare
// returned: a message without an ID is numbered among the request's messages
// of its Name (see Message.Name) each time it goes through Prepare.
func Prepare(ctx context.Context, m Message, maxPayload int) (Message, error) {
	if maxPayload <= 0 {
		maxPayload = DefaultMaxPayload
	}
	scope, key, events, inRequest := keyOf(ctx)
	numbered := m.ID == ""
	if m.ID == "" {
		if !inRequest {
			return m, ErrNoID
		}
		m.ID = MessageID(scope, key, m.Name) // numbered below, once m passes the checks
	}
	if m.PartitionKey == "" {
		if inRequest {
			m.PartitionKey = PartitionOf(scope, key)
		} else {
			m.PartitionKey = m.ID
		}
	}
	if err := check(m, maxPayload); err != nil {
		return m, err
	}
	if numbered && events != nil {
		if n := events.Next(m.Name); n > 1 {
			m.ID = NthMessageID(scope, key, m.Name, n)
		}
	}
	if m.Payload == nil {
		m.Payload = []byte{}
	}
	return m, nil
}

func check(m Message, maxPayload int) error {
	if len(m.ID) > MaxIDLength || !visibleASCII(m.ID) {
		return fmt.Errorf("%w: ID %q: it must be 1 to %d bytes of visible ASCII (no spaces or control characters); outbox.MessageID makes one", ErrInvalid, clip(m.ID), MaxIDLength)
	}
	if m.Subject == "" {
		return fmt.Errorf("%w: Subject is empty: name where the event goes (a NATS subject, an AMQP routing key, a Watermill topic)", ErrInvalid)
	}
	if len(m.Subject) > MaxSubjectLength || !subjectOK(m.Subject) {
		return fmt.Errorf("%w: Subject %q: it must be 1 to %d bytes of printable UTF-8 without spaces", ErrInvalid, clip(m.Subject), MaxSubjectLength)
	}
	if ReservedSubject(m.Subject) {
		return fmt.Errorf("%w: Subject %q is reserved: subjects starting with $ ($JS., $SYS., $KV., $O.…) or _INBOX. belong to the NATS server and JetStream's API, and the relay would publish into them; name an application subject such as orders.created", ErrInvalid, clip(m.Subject))
	}
	if len(m.PartitionKey) > MaxPartitionKeyLength || !utf8.ValidString(m.PartitionKey) || strings.ContainsRune(m.PartitionKey, 0) {
		return fmt.Errorf("%w: PartitionKey %q: it must be at most %d bytes of UTF-8 without NUL", ErrInvalid, clip(m.PartitionKey), MaxPartitionKeyLength)
	}
	if len(m.Payload) > maxPayload {
		return fmt.Errorf("%w: %d bytes, the outbox accepts at most %d (raise the store's MaxPayload, but not above what the broker accepts, or store the body elsewhere and send a reference)", ErrTooLarge, len(m.Payload), maxPayload)
	}
	if len(m.Headers) > MaxHeaders {
		return fmt.Errorf("%w: %d headers, at most %d", ErrInvalid, len(m.Headers), MaxHeaders)
	}
	size := 0
	for k, v := range m.Headers {
		size += len(k) + len(v)
		if k == "" || len(k) > MaxHeaderName || !token(k) {
			return fmt.Errorf("%w: header name %q: it must be 1 to %d bytes of letters, digits and !#$%%&'*+-.^_`|~", ErrInvalid, clip(k), MaxHeaderName)
		}
		if len(k) >= 5 && strings.EqualFold(k[:5], "nats-") {
			return fmt.Errorf("%w: header %q: names starting with Nats- are JetStream's (the relay sets Nats-Msg-Id to the message ID)", ErrInvalid, k)
		}
		if len(v) > MaxHeaderValue || !utf8.ValidString(v) || hasControl(v) {
			return fmt.Errorf("%w: header %q: the value must be at most %d bytes of UTF-8 without control characters (CR, LF, NUL…)", ErrInvalid, k, MaxHeaderValue)
		}
	}
	if size > MaxHeaderBytes {
		return fmt.Errorf("%w: headers of %d bytes, at most %d (names and values together)", ErrInvalid, size, MaxHeaderBytes)
	}
	return nil
}

// ReservedSubject reports whether s starts with $ (the NATS server's and
// JetStream's own subjects: $JS.API…, $SYS…, $KV…, $O…) or with _INBOX.
// (request replies). Prepare refuses such a subject with ErrInvalid: a
// relay publishing $JS.API.STREAM.DELETE.X would call the JetStream API.
func ReservedSubject(s string) bool {
	return strings.HasPrefix(s, "$") || strings.HasPrefix(s, "_INBOX.")
}

func clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

func visibleASCII(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] <= ' ' || s[i] >= 0x7f {
			return false
		}
	}
	return true
}

func subjectOK(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if r <= ' ' || r == 0x7f || (r >= 0x80 && r < 0xa0) || r == '\u2028' || r == '\u2029' || r == '\ufeff' {
			return false
		}
	}
	return true
}

func hasControl(s string) bool {
	for _, r := range s {
		if (r < ' ' && r != '\t') || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return true
		}
	}
	return false
}

func token(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}
