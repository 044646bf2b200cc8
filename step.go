package idem

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Recorded steps (issue 27; docs/effects.md): a call to another service, made
// by the handler of an operation idem runs, whose outcome is recorded durably
// — on its own, outside the business transaction — before Step returns, so
// that a retry or a takeover of the operation carries on from it instead of
// calling the service again.

// Errors of Step. Check them with errors.Is.
var (
	// ErrStepUnknown is returned by Step, with OnUnknown(StepRefuse), for a
	// step an earlier execution of the operation began and never recorded the
	// outcome of: the other service may or may not have acted. The operation's
	// outcome is marked unknown (as MarkOutcomeUnknown does): the handler
	// should answer 5xx, and the key stays in flight until an operator settles
	// the step (idem resolve --step) or the key.
	ErrStepUnknown = errors.New("idem: the step was begun by an earlier execution and its outcome was never recorded")
	// ErrStepFailed is the errors.Is target of a *StepFailedError: the step
	// failed for good (the handler marked the error with StepFinal), now or in
	// an earlier execution, and the failure is recorded.
	ErrStepFailed = errors.New("idem: the step failed for good")
	// ErrStepNotRecorded is returned, wrapping the cause, when the step ran
	// but its outcome could not be recorded (the store failed, the execution
	// lost the step to another one, or the result does not round-trip through
	// encoding/json). The step stays started: the next execution runs it again
	// with the same derived key (or refuses, with OnUnknown(StepRefuse)). The
	// handler should answer 5xx.
	ErrStepNotRecorded = errors.New("idem: the step ran but its outcome could not be recorded")
	// ErrStepOtherRequest is returned by Step, which does not run the step,
	// when the step is recorded for another request with the same key, or,
	// at an execution's first Step, when any step of the key is (a step the
	// first request never recorded is not run for another either): the
	// key was released (an answer not kept, after the step had begun or been
	// recorded) and then reused with a different request, and the recorded
	// outcome and derived key belong to the first one. The HTTP middleware
	// then answers 422 idempotency_key_reused instead of the handler's answer,
	// stores nothing and releases the key, so that the first request, retried
	// as it was sent, still finds its steps. Send a new key for a new
	// request.
	ErrStepOtherRequest = errors.New("idem: the step is recorded for a different request with this key")
	// ErrStepAfterHandler is returned by Step, which does not run the step and
	// records no outcome, when the request's handler has already returned (a
	// goroutine it left running called Step): the answer is stored or sent
	// without the step, and a retry replays it and never runs the step, so
	// the step's effect would belong to no answer. Run every step inside the
	// handler, before it answers; wait for goroutines that run steps.
	ErrStepAfterHandler = errors.New("idem: Step was called after the request's handler returned")
	// ErrNoStepStore is returned by Step when ctx is not the context of an
	// operation idem runs (a keyed request's handler, a consumer's message
	// handler), or when the store keeps no step records (is no StepStore).
	ErrNoStepStore = errors.New("idem: no step store for this context")
)

// UnknownPolicy says what Step does with a step an earlier execution began
// and never recorded the outcome of (it crashed, or lost its lease, between
// beginning the step and recording it).
type UnknownPolicy uint8

const (
	// StepRerun, the default, runs the step again with the same derived key:
	// right for a service that honours Idempotency-Key (it replays its first
	// answer), and for one whose effect may safely happen twice.
	StepRerun UnknownPolicy = iota
	// StepRefuse does not run it again: Step returns ErrStepUnknown and the
	// operation's outcome becomes unknown until an operator settles it. For a
	// service that honours no key and whose effect must not happen twice.
	StepRefuse
)

// String returns "rerun" or "refuse".
func (p UnknownPolicy) String() string {
	switch p {
	case StepRerun:
		return "rerun"
	case StepRefuse:
		return "refuse"
	}
	return fmt.Sprintf("UnknownPolicy(%d)", uint8(p))
}

// StepOption configures one Step call.
type StepOption func(*stepConfig)

type stepConfig struct {
	unknown UnknownPolicy
}

// OnUnknown sets what Step does with a step begun and never recorded by an
// earlier execution (StepRerun by default).
func OnUnknown(p UnknownPolicy) StepOption {
	return func(c *stepConfig) { c.unknown = p }
}

// StepFinal marks err as a final failure of a step: Step records it, and
// every later execution gets the same failure (a *StepFailedError) without
// running the step again — a card decline. An error not marked final is
// transient (a 503 from the provider): it is not recorded, and the next
// execution runs the step again with the same derived key. StepFinal(nil) is
// nil.
func StepFinal(err error) error {
	if err == nil {
		return nil
	}
	return &stepFinalError{err}
}

type stepFinalError struct{ err error }

func (e *stepFinalError) Error() string { return e.err.Error() }
func (e *stepFinalError) Unwrap() error { return e.err }

// StepAmbiguous marks err as a failure after which the other service may or
// may not have acted (a timeout, a connection dropped after the request was
// sent): Step records nothing and leaves the step begun, as a crash would, so
// that the next execution runs it again with the same derived key
// (StepRerun) or refuses it as unknown (StepRefuse). Step returns err
// unchanged. Without the mark an error is transient and the step is run again
// whatever the policy: use it for a service that honours no key.
// StepAmbiguous(nil) is nil.
func StepAmbiguous(err error) error {
	if err == nil {
		return nil
	}
	return &stepAmbiguousError{err}
}

type stepAmbiguousError struct{ err error }

func (e *stepAmbiguousError) Error() string { return e.err.Error() }
func (e *stepAmbiguousError) Unwrap() error { return e.err }

// StepFailedError is the error of a step that failed for good (StepFinal).
// errors.Is(err, ErrStepFailed) reports it. On the execution that ran the
// step it also wraps the error the step returned, so that errors.Is and
// errors.As find it; a later execution has only its recorded Message.
type StepFailedError struct {
	// Step is the step's name.
	Step string
	// Message is the text of the error the step failed with, as recorded.
	Message string
	err     error
}

// Error says which step failed and how.
func (e *StepFailedError) Error() string {
	return fmt.Sprintf("idem: step %q failed for good: %s", e.Step, e.Message)
}

// Is reports whether target is ErrStepFailed.
func (e *StepFailedError) Is(target error) bool { return target == ErrStepFailed }

// Unwrap returns the error the step returned, on the execution that ran it.
func (e *StepFailedError) Unwrap() error { return e.err }

// stepFailure is the recorded form of a final failure.
type stepFailure struct {
	Message string `json:"message"`
}

// Step runs fn as the step called name of the operation ctx belongs to (a
// keyed request idem executes, or a message a consumer dedupes), or returns
// its recorded outcome without running fn.
//
// The first time, Step records that the step began (committed on its own,
// before fn runs, fenced by the execution's hold on the key), runs fn with
// the step's derived key — send it as the Idempotency-Key of the call to the
// other service — and records fn's outcome before it returns:
//   - a result is encoded with encoding/json and recorded; Step returns it as
//     recorded (encoded and decoded again), so that this execution and every
//     later one see the same value;
//   - an error marked with StepFinal is recorded as the step's failure, and
//     Step returns a *StepFailedError (errors.Is(err, ErrStepFailed));
//   - an error marked with StepAmbiguous (the service may have acted) is
//     not recorded and leaves the step begun, as a crash would: the next
//     execution reruns it or refuses it (OnUnknown); Step returns the error;
//   - any other error is transient: nothing is recorded, the step is left to
//     be run again by the next execution with the same derived key, whatever
//     its OnUnknown, and Step returns the error unchanged;
//   - a panic in fn leaves the step begun and unrecorded (fn may have acted),
//     and goes on.
//
// Later — a retry after a crash, a takeover after a lapsed lease, the same
// name again in this execution — a recorded step returns its result, or its
// *StepFailedError, without running fn. A step an earlier execution began
// and never recorded is run again with the same derived key, or refused with
// OnUnknown(StepRefuse) (ErrStepUnknown). The same name used twice at once in
// one execution is an error.
//
// The derived key is stable across retries, takeovers and restarts of the
// operation, different for every (scope, key, name), and reveals nothing of
// the client's key. Records of steps expire with their operation's record: a
// key reused after its TTL is a new operation, with new derived keys.
//
// name is 1 to MaxStepNameLength bytes of visible ASCII. Step returns an
// error wrapping ErrNoStepStore when ctx is not such an operation's context
// or its store is not a StepStore, one wrapping ErrLockLost (fn not run) when
// the execution lost its hold on the key, and one wrapping ErrStepNotRecorded
// when fn ran and its outcome could not be recorded. See docs/effects.md.
func Step[T any](ctx context.Context, name string, fn func(ctx context.Context, key string) (T, error), opts ...StepOption) (T, error) {
	var zero T
	var cfg stepConfig
	for _, o := range opts {
		if o != nil {
			o(&cfg)
		}
	}
	if err := checkStepName(name); err != nil {
		return zero, err
	}
	if fn == nil {
		return zero, fmt.Errorf("idem: Step %q was given a nil function", name)
	}
	run, err := stepRunOf(ctx)
	if err != nil {
		return zero, fmt.Errorf("idem: step %q: %w", name, err)
	}
	if ctx.Err() != nil {
		return zero, fmt.Errorf("idem: step %q was not begun, and not run: the handler's context has ended: %w", name, context.Cause(ctx))
	}
	if run.returned != nil && run.returned.Load() {
		return zero, fmt.Errorf("%w: step %q was not begun, and not run: the answer is stored or sent without it; run every step inside the handler, before it answers", ErrStepAfterHandler, name)
	}
	if err := checkEncodable(zero); err != nil {
		return zero, fmt.Errorf("idem: step %q was not begun, and not run: its result type %T cannot be encoded with encoding/json (%v), so its outcome could never be recorded", name, zero, err)
	}
	breq := BeginStepRequest{
		Scope: run.scope, Key: run.key, Name: name, Owner: run.owner, Holder: run.holder,
		Rerun: cfg.unknown == StepRerun, DerivedKey: deriveStepKey(run.scope, run.key, name),
		Fingerprint: run.fp, Now: run.now(), ExpiresAt: run.expiresAt,
	}
	// The first BeginStep of the execution also looks at every other step
	// record of the key: a step the first request with the key never
	// recorded is not run for another request either.
	breq.First = breq.Fingerprint != "" && !run.checked.Load()
	rec, began, err := run.store.BeginStep(ctx, breq)
	for try := 0; err == nil && rec != nil && !began && otherFingerprint(breq.Fingerprint, rec.Fingerprint); try++ {
		other := try >= 2 || run.sameRequest == nil || !run.sameRequest(rec.Fingerprint)
		if !other && breq.First {
			// A record of the key is this request's, fingerprinted under an
			// older algorithm: ask about every record, one by one.
			other, err = run.otherSteps(ctx)
			breq.First = false
		}
		if err != nil {
			break
		}
		if other {
			if run.otherRequest != nil {
				run.otherRequest()
			}
			return zero, fmt.Errorf("%w: step %q was not run: this key's steps are recorded for the request it was first used with, and this request differs from it; a key names one operation, so send a new key for a new request", ErrStepOtherRequest, name)
		}
		if rec.Name == name {
			// The step's own record, of this request under an older
			// fingerprint version: ask again as that request.
			breq.Fingerprint = rec.Fingerprint
		}
		rec, began, err = run.store.BeginStep(ctx, breq)
	}
	if err == nil && rec != nil {
		run.checked.Store(true)
	}
	switch {
	case errors.Is(err, ErrLockLost):
		return zero, fmt.Errorf("idem: step %q was not begun, and not run: this execution no longer holds its key (its lease lapsed and another execution took it over): %w", name, ErrLockLost)
	case err != nil:
		return zero, fmt.Errorf("idem: step %q was not begun, and not run: the step store failed: %w", name, err)
	case rec == nil:
		return zero, fmt.Errorf("idem: step %q was not begun, and not run: the step store's BeginStep returned no record", name)
	}
	run.noteKey(name, rec.DerivedKey)
	if began && run.returned != nil && run.returned.Load() {
		// The handler returned while BeginStep was under way: leave the step
		// as a transient failure would (begun again, with its derived key, by
		// a retry that runs it), its function not called.
		fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), run.cleanup)
		defer cancel()
		aerr := run.store.AbandonStep(fctx, run.scope, run.key, name, run.owner, run.now())
		if errors.Is(aerr, ErrLockLost) {
			aerr = nil
		}
		return zero, errors.Join(fmt.Errorf("%w: step %q was begun as the handler returned, and not run: the answer is stored or sent without it; run every step inside the handler, before it answers", ErrStepAfterHandler, name), aerr)
	}
	if !began {
		return recordedStep[T](run, name, rec)
	}
	v, ferr := fn(ctx, rec.DerivedKey) // a panic goes on, the step left begun
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), run.cleanup)
	defer cancel()
	if ferr == nil {
		b, out, err := roundTrip(v)
		if err != nil {
			return zero, fmt.Errorf("%w: step %q ran, but its result does not round-trip through encoding/json (%v), so it was not recorded and the step stays begun; make its type encode and decode losslessly", ErrStepNotRecorded, name, err)
		}
		if err := run.store.FinishStep(fctx, run.scope, run.key, name, run.owner, StepDone, b, run.now()); err != nil {
			return zero, fmt.Errorf("%w: step %q ran, and recording its result failed (%w); the step stays begun, and the next execution runs it again with the same derived key or refuses it (OnUnknown)", ErrStepNotRecorded, name, err)
		}
		return out, nil
	}
	var final *stepFinalError
	if errors.As(ferr, &final) {
		msg := ferr.Error()
		b, _ := json.Marshal(stepFailure{Message: msg}) // a string always encodes
		if err := run.store.FinishStep(fctx, run.scope, run.key, name, run.owner, StepFailed, b, run.now()); err != nil {
			return zero, fmt.Errorf("%w: step %q failed for good (%w), and recording the failure failed (%w); the step stays begun", ErrStepNotRecorded, name, ferr, err)
		}
		return zero, &StepFailedError{Step: name, Message: msg, err: ferr}
	}
	var ambiguous *stepAmbiguousError
	if errors.As(ferr, &ambiguous) {
		return zero, ferr // left begun: the next execution reruns or refuses it
	}
	if err := run.store.AbandonStep(fctx, run.scope, run.key, name, run.owner, run.now()); err != nil && !errors.Is(err, ErrLockLost) {
		// The step stays begun under this execution: the next one runs it
		// again (StepRerun) or refuses it (StepRefuse), as after a crash.
		return zero, errors.Join(ferr, fmt.Errorf("idem: step %q failed (not for good), and marking it to be run again failed: %w", name, err))
	}
	return zero, ferr
}

// recordedStep is Step's answer for a step it did not begin.
func recordedStep[T any](run *stepRun, name string, rec *StepRecord) (T, error) {
	var out T
	switch rec.State {
	case StepDone:
		if err := json.Unmarshal(rec.Result, &out); err != nil {
			var zero T
			return zero, fmt.Errorf("idem: step %q is recorded as done, and its recorded result does not decode into %T (%v); it is not run again, since it took effect: decode into the type it was recorded with, or settle the step (idem resolve --step)", name, zero, err)
		}
		return out, nil
	case StepFailed:
		var f stepFailure
		if err := json.Unmarshal(rec.Result, &f); err != nil {
			f.Message = string(rec.Result)
		}
		return out, &StepFailedError{Step: name, Message: f.Message}
	case StepStarted:
		if rec.Owner == run.owner {
			return out, fmt.Errorf("idem: step %q is already running in this execution: one name is one step, run once at a time; give each step of the operation a name of its own", name)
		}
		if run.unknown != nil {
			run.unknown()
		}
		return out, fmt.Errorf("%w: step %q (derived key %s) was begun by an earlier execution of this operation, which did not record whether it took effect, and OnUnknown(StepRefuse) keeps it from running again; the operation's outcome is unknown until an operator settles the step (idem resolve --step %s)", ErrStepUnknown, name, rec.DerivedKey, name)
	}
	return out, fmt.Errorf("idem: step %q has a record in state %v, which Step does not know", name, rec.State)
}

// otherFingerprint reports whether a step record's fingerprint says it
// belongs to another request than the one fingerprinted current: both are
// set and differ.
func otherFingerprint(current, stored string) bool {
	return current != "" && stored != "" && current != stored
}

// checkEncodable reports a result type encoding/json cannot encode at all (a
// channel, a function, a complex number), found by encoding its zero value;
// a type whose own MarshalJSON refuses the zero value is no such type.
func checkEncodable(zero any) error {
	_, err := json.Marshal(zero)
	var unsupported *json.UnsupportedTypeError
	if errors.As(err, &unsupported) {
		return err
	}
	return nil
}

// roundTrip encodes v and decodes it again, returning the encoding and the
// decoded value.
func roundTrip[T any](v T) ([]byte, T, error) {
	var out T
	b, err := json.Marshal(v)
	if err != nil {
		return nil, out, err
	}
	if err := json.Unmarshal(b, &out); err != nil {
		return nil, out, fmt.Errorf("its encoding %.100s does not decode into %T: %w", b, out, err)
	}
	return b, out, nil
}

// StepKey returns the derived key of the step called name, once this
// execution has begun or read it with Step (for logging); ok is false
// otherwise.
func StepKey(ctx context.Context, name string) (key string, ok bool) {
	run, err := stepRunOf(ctx)
	if err != nil {
		return "", false
	}
	run.mu.Lock()
	defer run.mu.Unlock()
	key, ok = run.keys[name]
	return key, ok
}

// checkStepName reports a name Step does not accept.
func checkStepName(name string) error {
	if name == "" || len(name) > MaxStepNameLength {
		return fmt.Errorf("idem: invalid step name %.120q: a step name is 1 to %d bytes of visible ASCII, and this one has %d", name, MaxStepNameLength, len(name))
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c < 0x21 || c > 0x7e {
			return fmt.Errorf("idem: invalid step name %.120q: byte 0x%02x at position %d is not visible ASCII", name, c, i)
		}
	}
	return nil
}

// deriveStepKey returns a new derived key for (scope, key, name): "idem_" and
// 32 characters of base64url (192 bits of SHA-256 over the three and 16
// random bytes). The random part makes it reveal nothing of the client's key
// and differ for a key reused after its TTL; it is stable because it is
// recorded, with the step, before the step runs.
func deriveStepKey(scope, key, name string) string {
	var salt [16]byte
	_, _ = rand.Read(salt[:]) // crypto/rand.Read never fails (Go 1.24+)
	h := sha256.New()
	h.Write([]byte("idem-step-v1\x00"))
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(key))
	h.Write([]byte{0})
	h.Write([]byte(name))
	h.Write([]byte{0})
	h.Write(salt[:])
	return "idem_" + base64.RawURLEncoding.EncodeToString(h.Sum(nil)[:24])
}

// stepRun is what Step needs of the operation its context belongs to: made on
// the first Step of an execution, so that requests that use no step cost
// nothing.
type stepRun struct {
	store      StepStore
	scope, key string
	owner      string
	holder     bool
	expiresAt  time.Time
	now        func() time.Time
	cleanup    time.Duration
	unknown    func() // marks the operation's outcome unknown
	fp         string // the request's fingerprint ("" for none)
	// sameRequest reports whether a stored fingerprint of another version is
	// this request's (nil: none is).
	sameRequest  func(stored string) bool
	otherRequest func()       // marks the request as reusing another request's key
	returned     *atomic.Bool // set when the request's handler returned (nil outside HTTP)
	// checked is set once a BeginStep of the execution looked at every step
	// record of the key for another request's (BeginStepRequest.First).
	checked atomic.Bool

	mu   sync.Mutex
	keys map[string]string // derived keys by name, for StepKey
}

// otherSteps reports whether a live step record of the operation belongs to
// another request: its fingerprint differs from the request's and is not the
// request's under another fingerprint version.
func (r *stepRun) otherSteps(ctx context.Context) (bool, error) {
	recs, err := r.store.GetSteps(ctx, r.scope, r.key, r.now())
	if err != nil {
		return false, err
	}
	same := map[string]bool{}
	for _, rec := range recs {
		if !otherFingerprint(r.fp, rec.Fingerprint) {
			continue
		}
		ok, seen := same[rec.Fingerprint]
		if !seen {
			ok = r.sameRequest != nil && r.sameRequest(rec.Fingerprint)
			same[rec.Fingerprint] = ok
		}
		if !ok {
			return true, nil
		}
	}
	return false, nil
}

func (r *stepRun) noteKey(name, key string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.keys == nil {
		r.keys = make(map[string]string)
	}
	r.keys[name] = key
}

// stepsKey is the context key of a *stepRun set up by WithSteps.
type stepsKey struct{}

// stepRunOf returns the steps of the operation ctx belongs to.
func stepRunOf(ctx context.Context) (*stepRun, error) {
	if ctx == nil {
		return nil, fmt.Errorf("%w: the context is nil", ErrNoStepStore)
	}
	if rw, ok := ctx.Value(recorderKey{}).(*recorder); ok && rw.req != nil {
		return rw.req.stepRun()
	}
	if run, ok := ctx.Value(stepsKey{}).(*stepRun); ok {
		if run.store == nil {
			return nil, fmt.Errorf("%w: the consumer's store keeps no step records (it is no idem.StepStore)", ErrNoStepStore)
		}
		return run, nil
	}
	return nil, fmt.Errorf("%w: the context is not the handler's context of a request idem executes, nor a consumer message's; call Step with the context the handler was given (r.Context())", ErrNoStepStore)
}

// stepRun returns the request's steps, making them on first use: the owner is
// the claim's token in the claim-then-complete flow (fenced on the record,
// Holder), and a token of the execution's own in the single-transaction flow,
// whose record is not committed while the handler runs. Step records expire
// at the request's start plus TTL, never after the record the request claims
// or inserts.
func (req *request) stepRun() (*stepRun, error) {
	if run := req.rw.steps.Load(); run != nil {
		return run, nil
	}
	ss, ok := req.h.store.(StepStore)
	if !ok {
		return nil, fmt.Errorf("%w: the store (%T) keeps no step records (it is no idem.StepStore); memstore, sqlitestore, pgstore, mysqlstore and redisstore do", ErrNoStepStore, req.h.store)
	}
	req.mu.Lock()
	owner, holder := req.token, req.renew && req.token != ""
	req.mu.Unlock()
	if !holder {
		owner = newToken()
	}
	rw := &req.rw
	run := &stepRun{
		store: ss, scope: rw.scope, key: rw.key, owner: owner, holder: holder,
		expiresAt: req.start.Add(req.h.TTL), now: req.h.NowFunc, cleanup: req.h.CleanupTimeout,
		unknown: func() { rw.unknown = true }, returned: &rw.returned,
		fp: req.fp, sameRequest: func(stored string) bool {
			match, _ := sameRequest(req.fp, stored, req.r, req.body)
			return match
		},
		otherRequest: func() { rw.otherRequest.Store(true) },
	}
	if !req.rw.steps.CompareAndSwap(nil, run) {
		return req.rw.steps.Load(), nil
	}
	return run, nil
}

// keepSteps moves the expiry of every live step record of an operation this
// execution took over (claim-then-complete, under token) to this execution's
// (its start plus TTL), before its handler runs.
func (h *handler) keepSteps(req *request, token string) {
	if ss, ok := h.store.(StepStore); ok {
		same := func(stored string) bool {
			match, _ := sameRequest(req.fp, stored, req.r, req.body)
			return match
		}
		keepSteps(req.r.Context(), ss, req.scope, req.key, token, req.fp, same, h.NowFunc(), req.start.Add(h.TTL), h.CleanupTimeout)
	}
}

// keepSteps moves the expiry of every live step record of (scope, key) to
// exp, fenced on the request record held under owner. A takeover's claim
// moved the record's expiry to now plus TTL; a step recorded by an earlier
// execution, which the taking one does not reach before that execution's
// step expiry, would otherwise count as absent while the operation lives and
// run again with a new derived key. Best effort, and only on takeovers: a
// store that fails here leaves the expiries as they were. A record of another
// fingerprint is left alone unless same (nil: none is) says it is this
// request's under an older fingerprint version; it is then asked for under
// the fingerprint it was stored with.
func keepSteps(ctx context.Context, ss StepStore, scope, key, owner, fp string, same func(stored string) bool, now, exp time.Time, timeout time.Duration) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	recs, err := ss.GetSteps(ctx, scope, key, now)
	if err != nil {
		return
	}
	sameAs := "" // the last other fingerprint same said is this request's
	for _, rec := range recs {
		if !rec.ExpiresAt.Before(exp) {
			continue
		}
		recFP := fp
		if otherFingerprint(fp, rec.Fingerprint) {
			if rec.Fingerprint != sameAs && (same == nil || !same(rec.Fingerprint)) {
				continue
			}
			sameAs, recFP = rec.Fingerprint, rec.Fingerprint
		}
		// Rerun unset: a step another execution began stays its (and
		// unknown); a done or failed one only has its expiry moved.
		_, began, err := ss.BeginStep(ctx, BeginStepRequest{
			Scope: scope, Key: key, Name: rec.Name, Owner: owner, Holder: true,
			DerivedKey: deriveStepKey(scope, key, rec.Name), Fingerprint: recFP, Now: now, ExpiresAt: exp,
		})
		if err != nil {
			return
		}
		if began {
			// An abandoned step (or one that expired meanwhile) was begun:
			// abandon it again, keeping its derived key, for the handler's
			// Step to begin it.
			_ = ss.AbandonStep(ctx, scope, key, rec.Name, owner, now)
		}
	}
}

// StepOperation is the operation steps belong to, for code that runs an
// operation under a Store outside the HTTP middleware (the consumer package
// does, for message handlers): WithSteps puts it in a context, and Step
// called with that context records the operation's steps.
type StepOperation struct {
	// Store keeps the step records. A store that is no StepStore makes Step
	// return ErrNoStepStore.
	Store Store
	// Scope and Key are the operation's record's (stored forms).
	Scope, Key string
	// Owner is the token of this execution: the claim's lock token when
	// Holder is set.
	Owner string
	// Holder fences the steps on the operation's record: Step begins a step
	// only while the record is in flight under Owner (claim-then-complete).
	Holder bool
	// ExpiresAt is when the step records expire: never after the
	// operation's record does (the claim's ExpiresAt).
	ExpiresAt time.Time
	// NowFunc is the clock (defaults to time.Now).
	NowFunc func() time.Time
	// CleanupTimeout bounds the recording of a step's outcome, which does not
	// end with the handler's context (defaults to DefaultCleanupTimeout).
	CleanupTimeout time.Duration
	// OnUnknown, when set, is called when a step is refused as unknown
	// (ErrStepUnknown), before Step returns.
	OnUnknown func()
	// Fingerprint, when set, is the operation's request fingerprint: it is
	// stored with each new step record, and a step recorded under another
	// fingerprint is refused (ErrStepOtherRequest, OnOtherRequest called).
	// Consumers leave it empty.
	Fingerprint string
	// OnOtherRequest, when set, is called when a step is refused as recorded
	// for another request (ErrStepOtherRequest), before Step returns.
	OnOtherRequest func()
	// TakenOver says the operation's claim took a lapsed one over (with
	// Holder): WithSteps then first moves the expiry of every live step
	// record of the operation to ExpiresAt, as the HTTP middleware does on a
	// takeover, so that steps earlier executions recorded live as long as
	// the operation's record.
	TakenOver bool
}

// WithSteps returns a context, derived from ctx, in which Step records the
// steps of op.
func WithSteps(ctx context.Context, op StepOperation) context.Context {
	ss, _ := op.Store.(StepStore)
	run := &stepRun{
		store: ss, scope: op.Scope, key: op.Key, owner: op.Owner, holder: op.Holder,
		expiresAt: op.ExpiresAt, now: op.NowFunc, cleanup: op.CleanupTimeout, unknown: op.OnUnknown,
		fp: op.Fingerprint, otherRequest: op.OnOtherRequest,
	}
	if run.now == nil {
		run.now = time.Now
	}
	if run.cleanup <= 0 {
		run.cleanup = DefaultCleanupTimeout
	}
	if run.owner == "" {
		run.owner = newToken()
	}
	if op.TakenOver && op.Holder && ss != nil {
		keepSteps(ctx, ss, run.scope, run.key, run.owner, run.fp, nil, run.now(), run.expiresAt, run.cleanup)
	}
	return context.WithValue(ctx, stepsKey{}, run)
}
