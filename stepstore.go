package idem

import (
	"context"
	"time"
)

// StepState is the state of a step record (see Step).
type StepState uint8

const (
	// StepStarted means an execution began the step and has not recorded how
	// it ended: the other service may or may not have acted.
	StepStarted StepState = 1
	// StepDone means the step succeeded and its result is recorded.
	StepDone StepState = 2
	// StepFailed means the step failed for good (the handler marked the error
	// final with StepFinal) and the failure is recorded.
	StepFailed StepState = 3
)

// String returns "started", "done", "failed" or "unknown".
func (s StepState) String() string {
	switch s {
	case StepStarted:
		return "started"
	case StepDone:
		return "done"
	case StepFailed:
		return "failed"
	}
	return "unknown"
}

// StepRecord is the durable record of one named step of one operation,
// identified by (Scope, Key, Name).
type StepRecord struct {
	// Scope and Key are those of the request record the step belongs to.
	Scope, Key string
	// Name is the step's name, as the handler gave it to Step.
	Name string
	// State is StepStarted, StepDone or StepFailed.
	State StepState
	// Owner is the token of the execution that began (or last re-ran) the
	// step: the claim's lock token in the claim-then-complete flow, a token
	// of the execution's own in the single-transaction flow. It is "" once the
	// owner abandoned the step (AbandonStep).
	Owner string
	// DerivedKey is the key the step sends to the other service as its
	// Idempotency-Key. It is chosen when the record is first written and never
	// changes while the record lives.
	DerivedKey string
	// Fingerprint is the fingerprint of the request whose execution first
	// wrote the record (BeginStepRequest.Fingerprint), in the format of
	// Record.Fingerprint ("v3:…"); "" for a record written without one (by a
	// consumer, or before step records carried it). It never changes while
	// the record lives.
	Fingerprint string
	// Result is the recorded result (StepDone) or failure (StepFailed), as the
	// middleware encoded it; nil while StepStarted.
	Result []byte
	// StartedAt is when the record was first written.
	StartedAt time.Time
	// ExpiresAt is when the record stops counting: from then on it is treated
	// as absent and DeleteExpired may delete it.
	ExpiresAt time.Time
}

// BeginStepRequest is what the middleware asks of StepStore.BeginStep.
type BeginStepRequest struct {
	// Scope and Key identify the request record (stored forms, as in
	// ClaimRequest).
	Scope, Key string
	// Name is the step's name: 1 to MaxStepNameLength bytes of visible ASCII.
	Name string
	// Owner is the token of the execution beginning the step.
	Owner string
	// Holder, when true, fences the step on the request record: BeginStep
	// returns ErrLockLost, writing nothing, unless the record for (Scope, Key)
	// is in flight under Owner and not expired at Now. The claim-then-complete
	// flow sets it; the single-transaction flow, whose record is not committed
	// while the handler runs, does not.
	Holder bool
	// Rerun, when true, lets BeginStep take over a live StepStarted record of
	// another owner: it becomes Owner's, keeping DerivedKey and StartedAt.
	Rerun bool
	// DerivedKey is the derived key to store when the record is new.
	DerivedKey string
	// Fingerprint is the request's fingerprint (as in ClaimRequest), stored
	// when the record is new; "" when the operation has none (a consumer's
	// message).
	Fingerprint string
	// First, when true with a Fingerprint set, makes BeginStep first look at
	// every live step record of (Scope, Key), whatever its name: when one has
	// a Fingerprint that is set and differs from req.Fingerprint (the key was
	// released and reused for another request), nothing is written and that
	// record is returned, began false, whatever req.Name's own record says;
	// rec.Name is then the other record's. The middleware sets it on the
	// first BeginStep of an execution, so that a step the first request never
	// recorded is not run for another request. It is decided in the same
	// atomic operation as the rest of BeginStep.
	First bool
	// Now is the middleware's clock reading.
	Now time.Time
	// ExpiresAt is the expiry of a new record; an existing live record's
	// expiry is moved to ExpiresAt when that is later.
	ExpiresAt time.Time
}

// MaxStepNameLength is the longest step name Step accepts.
const MaxStepNameLength = 100

// StepStore is implemented by stores that keep step records (see Step). Every
// method is one atomic operation on one step record, committed on its own,
// outside any business transaction.
type StepStore interface {
	// BeginStep atomically decides what happens to the step:
	//   - no live record (absent, or ExpiresAt <= req.Now): a StepStarted
	//     record of req.Owner with req.DerivedKey and req.Fingerprint is
	//     written; began is true.
	//   - with req.First, a live record of (Scope, Key), of any name, whose
	//     Fingerprint and req.Fingerprint are both set and differ: nothing is
	//     written; began is false, and rec is that record.
	//   - a live record whose Fingerprint and req.Fingerprint are both set and
	//     differ (the key was released and reused for another request): nothing
	//     is written, not even the expiry; began is false, and rec is the
	//     record as stored, for the caller to refuse the request.
	//   - a live StepStarted record without owner (abandoned): it becomes
	//     req.Owner's, keeping DerivedKey and StartedAt; began is true.
	//   - a live StepStarted record of another owner, and req.Rerun: it is
	//     taken over by req.Owner in the same way; began is true.
	//   - otherwise (StepDone, StepFailed, a StepStarted record of req.Owner,
	//     or of another owner without req.Rerun): nothing but the expiry is
	//     written and began is false.
	// rec is the record after the decision. With req.Holder it returns
	// ErrLockLost, writing nothing, when the request record is not in flight
	// under req.Owner.
	BeginStep(ctx context.Context, req BeginStepRequest) (rec *StepRecord, began bool, err error)

	// FinishStep records the end of the step begun by owner: state is
	// StepDone or StepFailed and result its encoded result. It returns
	// ErrLockLost, changing nothing, unless the record is live, StepStarted
	// and owner's.
	FinishStep(ctx context.Context, scope, key, name, owner string, state StepState, result []byte, now time.Time) error

	// AbandonStep clears the owner of the StepStarted record begun by owner,
	// after a failure the handler did not mark final (a transient one): the
	// record stays StepStarted with its derived key, and the next execution
	// begins the step again with the same derived key, whatever its Rerun. It
	// returns ErrLockLost, changing nothing, unless the record is live,
	// StepStarted and owner's.
	AbandonStep(ctx context.Context, scope, key, name, owner string, now time.Time) error

	// GetSteps returns the live step records of (scope, key), ordered by
	// StartedAt, for operators (idem inspect) and tests.
	GetSteps(ctx context.Context, scope, key string, now time.Time) ([]StepRecord, error)

	// SettleStep is for operators (idem resolve): it writes state and result
	// into the record whatever its owner (StepDone or StepFailed), or deletes
	// it (state 0). It returns ErrNotFound when there is no live record.
	SettleStep(ctx context.Context, scope, key, name string, state StepState, result []byte, now time.Time) error

	// DeleteExpiredSteps deletes at most limit step records whose ExpiresAt
	// <= now and reports how many it deleted; the Janitor calls it after
	// DeleteExpired. Stores whose records expire by themselves return 0, nil.
	DeleteExpiredSteps(ctx context.Context, now time.Time, limit int) (int, error)
}
