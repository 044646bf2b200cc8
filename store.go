package idem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// State is the state of a stored record. An absent record has no State: stores
// report it with ErrNotFound.
type State uint8

const (
	// StateInFlight means a request holds the key and its handler may be running.
	StateInFlight State = 1
	// StateComplete means the handler finished and its outcome is stored.
	StateComplete State = 2
)

// String returns "in_flight", "complete" or "unknown".
func (s State) String() string {
	switch s {
	case StateInFlight:
		return "in_flight"
	case StateComplete:
		return "complete"
	}
	return "unknown"
}

// Sentinel errors shared by the middleware and every store. Check them with errors.Is.
var (
	// ErrNotFound is returned by Store.Get when no record exists for (scope, key),
	// or when the record has expired.
	ErrNotFound = errors.New("idem: record not found")
	// ErrLockLost is returned by Complete, Release and Extend when the record's lock
	// token no longer matches the caller's: its lease lapsed and another request
	// took the key over, or the record expired and was reclaimed or deleted.
	ErrLockLost = errors.New("idem: lock lost (the lease lapsed and the key was taken over)")
	// ErrInFlight is returned by SingleTxStore.BeginLocked when another transaction
	// holds the key right now.
	ErrInFlight = errors.New("idem: key is in flight in another request")
	// ErrTxAborted is returned, wrapped, by Tx.Complete, Tx.Commit, LockedTx.Insert
	// and LockedTx.Commit when the database had already ended the handler's
	// transaction: a statement in it failed and aborted it (PostgreSQL), or it was
	// rolled back as a deadlock victim (MySQL). None of its writes commit, the
	// completion included; the store must make sure that no statement sent after
	// the abort committed either. The middleware then keeps the handler's answer
	// on its own when it is an error answer (status >= 400), and otherwise
	// releases the key and answers 500 (idempotency_transaction_aborted).
	ErrTxAborted = errors.New("idem: the database aborted the handler's transaction; none of its writes were committed")
	// ErrTxConflict is returned, wrapped together with ErrTxAborted, by Tx.Commit
	// and LockedTx.Commit when the database rolled the handler's transaction back
	// in a conflict with a concurrent one: a serialization failure (SQLSTATE
	// 40001, REPEATABLE READ and SERIALIZABLE) or a deadlock (40P01) in the
	// handler's statements, the completion or the COMMIT. Nothing was committed
	// and running it again may well succeed, so the middleware releases the key
	// and answers 503 idempotency_transaction_conflict with Retry-After: the
	// handler's answer, error or not, is not kept.
	ErrTxConflict = errors.New("idem: the database rolled the handler's transaction back in a conflict with a concurrent transaction; nothing was committed, retry")
)

// Response is the outcome of one execution, as kept in a complete record.
type Response struct {
	// Status is the HTTP status code the handler wrote.
	Status int
	// Header holds the allow-listed response headers (Config.StoredHeaders).
	Header http.Header
	// Body is the response body, byte for byte. It is nil when the body was not
	// kept (BodyOmitted).
	Body []byte
	// BodyOmitted reports that Body was deliberately not stored: the outcome is
	// kept as a resource reference or a marker, and Config.ReplayFunc rebuilds the
	// answer, or the body was larger than Config.MaxStoredBody.
	BodyOmitted bool
	// Ref is the resource reference the handler recorded with SetRef, for example
	// the ID of the order it created. Empty when none was recorded.
	Ref string
}

// Record is one idempotency record, identified by (Scope, Key).
type Record struct {
	// Scope is the tenant or principal that owns the key.
	Scope string
	// Key is the idempotency key, as parsed from the request header.
	Key string
	// State is StateInFlight or StateComplete.
	State State
	// Fingerprint identifies the request that claimed the key, prefixed with its
	// algorithm version ("v1:…").
	Fingerprint string
	// Token is the lock token of the claim that holds the key while the record
	// is in flight. Complete, Release and Extend compare it. A store may drop
	// it once the record is complete (memstore does); it then reads as "".
	Token string
	// CreatedAt is when the record was first claimed.
	CreatedAt time.Time
	// LeaseUntil is when the in-flight claim lapses unless extended.
	LeaseUntil time.Time
	// ExpiresAt is when the record stops counting: from then on it is treated as
	// absent and the janitor may delete it.
	ExpiresAt time.Time
	// Response is the stored outcome; nil while the record is in flight.
	Response *Response
}

// ClaimRequest is what the middleware asks of Store.Claim.
type ClaimRequest struct {
	// Scope is the stored form of the request's scope (see StoredScope): valid
	// UTF-8 without control characters, at most MaxStoredScopeLength bytes.
	Scope string
	// Key is the parsed key: 1 to DefaultMaxKeyLength (255) bytes of visible ASCII.
	Key string
	// Fingerprint is the request's fingerprint with its version prefix (at most
	// a few hundred bytes of visible ASCII).
	Fingerprint string
	// Token is the lock token of this claim, unique to it: no other claim, in
	// this process or another, is made with the same token (22 characters of
	// base64url).
	Token string
	// Now is the middleware's clock reading; stores compare leases and expiry
	// against it, so tests can drive time.
	Now time.Time
	// LeaseUntil is the lease deadline of the new claim.
	LeaseUntil time.Time
	// ExpiresAt is the record's expiry (Now + Config.TTL).
	ExpiresAt time.Time
}

// Store keeps idempotency records. Every method is one atomic step on one record;
// the state machine that combines them lives in the middleware. Applications do not
// call a Store directly: they pass it to New.
//
// Times passed in are the middleware's clock readings; a store compares against
// them and never reads a clock of its own (a store that uses server-side expiry, like
// Redis, derives durations from them).
type Store interface {
	// Claim atomically claims (scope, key) for req.Token. The claim succeeds, and
	// claimed is true, when
	//   - no record exists, or the existing one has ExpiresAt <= req.Now (expired
	//     records count as absent and are replaced whole), or
	//   - the existing record is in flight, its LeaseUntil <= req.Now (the holder
	//     crashed or stalled) and its Fingerprint equals req.Fingerprint: it is taken
	//     over, keeping CreatedAt, with the new token, lease and expiry.
	// A successful claim stores an in-flight record and returns it.
	// Otherwise claimed is false, nothing is written, and rec is the existing record
	// as it was at the moment of the decision (in flight or complete, never expired).
	// Exactly one of any number of concurrent claims of one absent key succeeds.
	Claim(ctx context.Context, req ClaimRequest) (rec *Record, claimed bool, err error)

	// Complete stores resp and marks the record complete, with the given expiry, if
	// and only if the record is in flight under token. Otherwise it returns
	// ErrLockLost and changes nothing. now is the middleware's clock reading; a
	// store with server-side expiry sets it to expiresAt − now from now on.
	Complete(ctx context.Context, scope, key, token string, resp *Response, now, expiresAt time.Time) error

	// Release deletes the in-flight record held under token, so that the next request
	// with the key runs afresh. It returns ErrLockLost, changing nothing, when the
	// record is not in flight under token.
	Release(ctx context.Context, scope, key, token string) error

	// Extend moves the lease deadline of the in-flight record held under token to
	// leaseUntil, and its expiry to leaseUntil when the expiry is earlier: a record
	// whose lease is live never counts as expired, is never reclaimed and never
	// deleted, however long its handler runs past the TTL. now is the middleware's
	// clock reading (for stores with server-side expiry). It returns ErrLockLost
	// when the record is not in flight under token.
	Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error

	// Get returns the record for (scope, key). It returns ErrNotFound when there is
	// none or when it expired (ExpiresAt <= now).
	Get(ctx context.Context, scope, key string, now time.Time) (*Record, error)

	// DeleteExpired deletes at most limit records whose ExpiresAt <= now and reports
	// how many it deleted. Callers repeat it until it returns fewer than limit.
	// Stores whose records expire by themselves return 0, nil.
	DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error)
}

// ResponseCopier is implemented by stores that copy what they keep of a
// Response, never keeping the *Response passed to Complete (or to a
// transaction's Complete or Insert), its Header map or its Body: once the call
// returns — in a transaction, once Commit or Rollback returns — the caller may
// reuse that memory. When CopiesResponses reports true, the middleware does,
// saving a header map and its values per request. Every store in this module
// implements it; a store that does not gets a Response of its own to keep.
// storetest's ResponseCopied case checks the claim.
type ResponseCopier interface {
	CopiesResponses() bool
}

// TxStore is implemented by stores that can commit the completion in the same
// database transaction as the handler's business writes (docs/design.md §2). When the
// store passed to New implements it, the middleware runs every claimed request in
// a transaction: BeginTx before the handler, the fenced completion inside the
// transaction, Commit, and only then the response.
type TxStore interface {
	Store
	// BeginTx starts a transaction and returns a context that carries it, from which
	// the store's package exposes it to handlers (for example sqlitestore.Tx(ctx)).
	BeginTx(ctx context.Context) (context.Context, Tx, error)
}

// Tx is a business transaction opened by a TxStore.
type Tx interface {
	// Complete is Store.Complete inside the transaction: it returns ErrLockLost when
	// the record is no longer in flight under token, and the caller rolls back.
	// A store may instead defer the fenced write to Commit, sending both in one
	// round trip; Commit then returns ErrLockLost and commits nothing.
	Complete(ctx context.Context, scope, key, token string, resp *Response, now, expiresAt time.Time) error
	// Commit commits the transaction. It returns ErrLockLost, having committed
	// nothing, when a completion deferred to it found the fence broken.
	Commit(ctx context.Context) error
	// Rollback aborts the transaction. It is safe to call after Commit, as a no-op.
	Rollback(ctx context.Context) error
}

// SingleTxStore is implemented by stores that support the single-transaction flow
// (Config.Flow = FlowSingleTx): the in-flight signal is a lock that lives only as
// long as the business transaction, and the key record is written once, already
// complete, just before the one COMMIT.
type SingleTxStore interface {
	Store
	// BeginLocked starts a transaction, takes a transaction-scoped lock on (scope,
	// key) without waiting, and reads the record. It returns ErrInFlight when the
	// lock is held by another transaction. rec is nil when no live record exists
	// (absent or expired at now). The returned context carries the transaction as
	// BeginTx's does.
	BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, LockedTx, *Record, error)
}

// LockedTx is a transaction opened by SingleTxStore.BeginLocked.
type LockedTx interface {
	// Insert writes rec, already complete, replacing an expired record with the same
	// (scope, key) if one exists. It returns ErrInFlight when a live record appeared
	// meanwhile (a claim-then-complete request holds the key). A store may defer the
	// write to Commit, which then returns ErrInFlight and commits nothing.
	Insert(ctx context.Context, rec *Record) error
	// Commit commits the transaction and frees the lock — also when the commit
	// fails (the middleware calls Rollback after a failed Commit as well).
	Commit(ctx context.Context) error
	// Rollback aborts the transaction and frees the lock. Safe after Commit.
	Rollback(ctx context.Context) error
}

// ErrFieldTooLarge is returned, wrapped in a *FieldTooLargeError, by a store
// asked to keep a field longer than it can store exactly (a Ref larger than its
// column, a fingerprint longer than its index allows). The store changed
// nothing: no field is ever cut short. The middleware then keeps nothing of a
// transaction and answers 500 idempotency_response_too_large, which a retry
// would only meet again.
var ErrFieldTooLarge = errors.New("idem: a field is larger than the store keeps")

// FieldTooLargeError says which field a store could not keep, and how large it
// was. errors.Is(err, ErrFieldTooLarge) reports it.
type FieldTooLargeError struct {
	// Store names the store ("mysqlstore").
	Store string
	// Field is the field: "scope", "key", "fingerprint", "token", "headers",
	// "body" or "ref".
	Field string
	// Size is the field's size in bytes, Limit the most the store keeps.
	Size, Limit int64
}

// Error says which field is too large, by how much, and what to do about it.
func (e *FieldTooLargeError) Error() string {
	return fmt.Sprintf("%s: the %s is %d bytes, more than the %d bytes %s keeps, so nothing was stored; %s",
		e.Store, e.Field, e.Size, e.Limit, e.Store, fieldAdvice(e.Field))
}

// Is reports whether target is ErrFieldTooLarge.
func (e *FieldTooLargeError) Is(target error) bool { return target == ErrFieldTooLarge }

func fieldAdvice(field string) string {
	switch field {
	case "scope":
		return "let idem.New derive the stored scope (StoredScope replaces a long one with its digest)"
	case "key":
		return "send a shorter Idempotency-Key (lower Config.MaxKeyLength to refuse long ones with 400)"
	case "fingerprint":
		return "make Config.FingerprintFunc return a version and a digest (\"acme1:<sha-256 hex>\")"
	case "token":
		return "use the lock tokens idem makes (22 bytes)"
	case "headers":
		return "keep fewer or shorter response headers (Config.StoredHeaders)"
	case "body":
		return "lower Config.MaxStoredBody below the limit, or keep a reference (SetRef) with a ReplayFunc"
	case "ref":
		return "record a short reference with SetRef (an ID, not a document)"
	}
	return "store a smaller value"
}

// CheckFieldSize returns a *FieldTooLargeError for store and field when size
// is more than limit, and nil otherwise: the one check, and the one error,
// every store uses for its bounds.
func CheckFieldSize(store, field string, size, limit int64) error {
	if size > limit {
		return &FieldTooLargeError{Store: store, Field: field, Size: size, Limit: limit}
	}
	return nil
}
