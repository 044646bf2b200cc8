package idemobs

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// Op names a store operation.
type Op uint8

// The store operations a decorated Store reports. Their names (String) are
// the values of the op label of idem_store_duration_seconds and
// idem_store_errors_total.
const (
	OpClaim         Op = iota // Store.Claim
	OpComplete                // Store.Complete and Tx.Complete
	OpCommit                  // Tx.Commit and LockedTx.Commit
	OpRelease                 // Store.Release
	OpExtend                  // Store.Extend (lease renewal)
	OpGet                     // Store.Get
	OpDeleteExpired           // Store.DeleteExpired (the janitor)
	OpBegin                   // TxStore.BeginTx and SingleTxStore.BeginLocked
	OpInsert                  // LockedTx.Insert (single-transaction flow)
	NumOps                    // the number of operations, for arrays indexed by Op
)

var opNames = [NumOps]string{"claim", "complete", "commit", "release", "extend", "get", "delete_expired", "begin", "insert"}

// String returns the operation's snake_case name, as used in metric labels.
func (o Op) String() string {
	if o < NumOps {
		return opNames[o]
	}
	return "unknown"
}

// Outcomes lists the event kinds counted as request outcomes (every kind but
// EventClaimed, which starts a hold rather than ending a request).
var Outcomes = []idem.EventKind{
	idem.EventExecuted, idem.EventReplayed, idem.EventInFlight, idem.EventMismatch,
	idem.EventRejected, idem.EventStoreError, idem.EventLeaseLost, idem.EventReleased,
	idem.EventTakenOver,
}

// Failed reports whether err, returned by a store operation, is a failure of
// the store. The answers the protocol expects — ErrNotFound from Get,
// ErrLockLost from a fenced write whose lease was taken over, ErrInFlight from
// the single-transaction lock — are not failures, nor is ErrTxAborted (the
// handler's own statement failed).
func Failed(err error) bool {
	if err == nil {
		return false
	}
	return !errors.Is(err, idem.ErrNotFound) && !errors.Is(err, idem.ErrLockLost) &&
		!errors.Is(err, idem.ErrInFlight) && !errors.Is(err, idem.ErrTxAborted)
}

// Hash returns a short, stable stand-in for a key or a scope: the first 8 bytes
// of its SHA-256, in hex (16 characters). It lets one follow a key through logs
// and traces without writing the key itself. A scope drawn from a small set of
// guessable names (tenant IDs) can be recovered from its hash by trying them
// all: treat scope hashes as pseudonyms, not secrets.
func Hash(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:8])
}

// KeyHash returns the stand-in for key in scope that logs and spans carry
// (idem.key_hash): like Hash, but over the scope and the key together, so that
// the same key sent by two tenants (keys are chosen by clients) gives two
// hashes, and one tenant's key hash says nothing about another's. A key drawn
// from a small, guessable set (an order number rather than a random UUID) can
// still be recovered by trying each with the scope: treat key hashes as
// pseudonyms too.
func KeyHash(scope, key string) string {
	h := sha256.New()
	var n [8]byte
	binary.BigEndian.PutUint64(n[:], uint64(len(scope)))
	h.Write([]byte("idem key\x00"))
	h.Write(n[:])
	h.Write([]byte(scope))
	h.Write([]byte(key))
	var sum [sha256.Size]byte
	return hex.EncodeToString(h.Sum(sum[:0])[:8])
}

// Redact returns msg, an error's message, with the key and the scope replaced
// by "key#"+KeyHash(scope, key) and "scope#"+Hash(scope) wherever it names them: raw,
// Go-quoted (as %q writes them: a key may hold '"' and '\', a scope any byte),
// or cut short (a store that quotes only the first bytes of a long key). Store
// errors name the key; observers that pass an error on use Redact to keep
// hashes only.
func Redact(msg, key, scope string) string {
	if key != "" {
		msg = redactOne(msg, key, "key#"+KeyHash(scope, key))
	}
	if scope != "" {
		msg = redactOne(msg, scope, "scope#"+Hash(scope))
	}
	return msg
}

// minRedactedPrefix is the shortest leading part of a key or scope Redact
// looks for: shorter ones would hide ordinary words, and reveal little.
const minRedactedPrefix = 16

func redactOne(msg, s, repl string) string {
	q := strconv.Quote(s)
	q = q[1 : len(q)-1]
	msg = strings.ReplaceAll(msg, s, repl)
	if q != s {
		msg = strings.ReplaceAll(msg, q, repl)
	}
	msg = redactPrefixes(msg, s, repl)
	if q != s {
		msg = redactPrefixes(msg, q, repl)
	}
	return msg
}

// redactPrefixes replaces every run in msg that is a leading part of form at
// least minRedactedPrefix bytes long (a store that quotes only the first bytes
// of a long key). It takes time linear in len(msg) per occurrence, whatever
// the length of form: a scope or key of any size must not make logging slow.
func redactPrefixes(msg, form, repl string) string {
	if len(form) <= minRedactedPrefix || !strings.Contains(msg, form[:minRedactedPrefix]) {
		return msg
	}
	head := form[:minRedactedPrefix]
	var b strings.Builder
	for {
		i := strings.Index(msg, head)
		if i < 0 {
			b.WriteString(msg)
			return b.String()
		}
		n := minRedactedPrefix
		for n < len(form) && i+n < len(msg) && msg[i+n] == form[n] {
			n++
		}
		b.WriteString(msg[:i])
		b.WriteString(repl)
		msg = msg[i+n:]
	}
}

// StoreObserver is told about every operation of a Store decorated with Store.
type StoreObserver interface {
	// StoreStart is called before the operation. The context it returns is
	// passed to the operation (for example one carrying a tracing span) and to
	// StoreDone; return ctx when there is nothing to add. For OpBegin the
	// operation gets the original context, because the transaction's context is
	// handed to the application's handler.
	StoreStart(ctx context.Context, op Op) context.Context
	// StoreDone is called after the operation with the time it took and its
	// error (see Failed for which errors are failures).
	StoreDone(ctx context.Context, op Op, took time.Duration, err error)
}

// Multi returns an Observer that passes every event to each of obs, in order.
// It is a ClaimObserver when one of them is, and passes EventClaimed only to
// those that want it.
func Multi(obs ...idem.Observer) idem.Observer {
	m := &multi{}
	for _, o := range obs {
		if o == nil {
			continue
		}
		co, ok := o.(idem.ClaimObserver)
		m.all = append(m.all, o)
		m.claims = append(m.claims, ok && co.ObservesClaims())
	}
	return m
}

type multi struct {
	all    []idem.Observer
	claims []bool
}

// ObservesClaims reports whether one of the observers wants EventClaimed.
func (m *multi) ObservesClaims() bool {
	for _, c := range m.claims {
		if c {
			return true
		}
	}
	return false
}

// Observe passes e on. Each observer is told whatever the others do: a panic
// of one is held until every other one has been told, then goes on (the first
// one, when several panic), so that a buggy exporter cannot keep the event
// from the others (idem_in_flight would stay raised).
func (m *multi) Observe(ctx context.Context, e idem.Event) {
	var p any
	for i, o := range m.all {
		if e.Kind == idem.EventClaimed && !m.claims[i] {
			continue
		}
		if v := observeOne(ctx, o, e); v != nil && p == nil {
			p = v
		}
	}
	if p != nil {
		panic(p)
	}
}

func observeOne(ctx context.Context, o idem.Observer, e idem.Event) (p any) {
	defer func() { p = recover() }()
	o.Observe(ctx, e)
	return nil
}

// MultiStore returns a StoreObserver that passes every operation to each of
// obs, in order (StoreStart's contexts are chained). Like Multi, it tells each
// observer whatever the others do and lets the first panic go on afterwards.
func MultiStore(obs ...StoreObserver) StoreObserver {
	var m multiStore
	for _, o := range obs {
		if o != nil {
			m = append(m, o)
		}
	}
	return m
}

type multiStore []StoreObserver

func (m multiStore) StoreStart(ctx context.Context, op Op) context.Context {
	var p any
	for _, o := range m {
		next, v := startOne(ctx, o, op)
		if v != nil {
			if p == nil {
				p = v
			}
			continue
		}
		ctx = next
	}
	if p != nil {
		panic(p)
	}
	return ctx
}

func startOne(ctx context.Context, o StoreObserver, op Op) (next context.Context, p any) {
	defer func() { p = recover() }()
	return o.StoreStart(ctx, op), nil
}

func (m multiStore) StoreDone(ctx context.Context, op Op, took time.Duration, err error) {
	var p any
	for i := len(m) - 1; i >= 0; i-- {
		if v := doneOne(ctx, m[i], op, took, err); v != nil && p == nil {
			p = v
		}
	}
	if p != nil {
		panic(p)
	}
}

func doneOne(ctx context.Context, o StoreObserver, op Op, took time.Duration, err error) (p any) {
	defer func() { p = recover() }()
	o.StoreDone(ctx, op, took, err)
	return nil
}
