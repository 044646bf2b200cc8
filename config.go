package idem

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"reflect"
	"slices"
	"strings"
	"time"
)

// Defaults for Config fields left at their zero value.
const (
	DefaultHeaderName     = "Idempotency-Key"
	DefaultLease          = 30 * time.Second
	DefaultTTL            = 24 * time.Hour
	DefaultMaxRequestBody = 1 << 20
	DefaultMaxStoredBody  = 1 << 20
	DefaultCleanupTimeout = 10 * time.Second
	DefaultHandlerTimeout = time.Minute
)

// DefaultMethods are the methods that carry a key unless Config.Methods says
// otherwise.
var DefaultMethods = []string{http.MethodPost, http.MethodPatch}

// DefaultStoredHeaders are the response headers kept for replay unless
// Config.StoredHeaders says otherwise.
var DefaultStoredHeaders = []string{
	"Content-Type", "Content-Language", "Content-Encoding", "Content-Location",
	"Location", "ETag", "Last-Modified", "Link",
}

// Flow chooses how a claimed request is carried out.
type Flow uint8

const (
	// FlowAuto, the zero value, is the store's preferred flow: FlowSingleTx for a
	// SingleTxStore that reports it as its PreferredFlow (it is the faster of the
	// two there, with the same guarantees), FlowClaimComplete otherwise.
	FlowAuto Flow = iota
	// FlowClaimComplete commits the claim on its own as "in flight" with a lease,
	// runs the handler (renewing the lease), then commits the completion — inside the
	// handler's transaction when the store is a TxStore. It works with every store
	// and suits handlers that call outside services.
	FlowClaimComplete
	// FlowSingleTx runs claim, handler and completion in one database transaction,
	// with a transaction-scoped lock as the in-flight signal. It needs a
	// SingleTxStore, and suits handlers whose side effects all live in that database.
	// An in-flight record left by a crashed claim-then-complete request with the
	// same key is taken over through Store.Claim once its lease lapsed.
	FlowSingleTx
)

// String returns "auto", "claim-complete" or "single-tx".
func (f Flow) String() string {
	switch f {
	case FlowAuto:
		return "auto"
	case FlowClaimComplete:
		return "claim-complete"
	case FlowSingleTx:
		return "single-tx"
	}
	return fmt.Sprintf("Flow(%d)", uint8(f))
}

// FlowPreferrer is implemented by stores that name the flow FlowAuto picks for
// them.
type FlowPreferrer interface {
	PreferredFlow() Flow
}

// ReplayFunc rebuilds the answer to a retry from a complete record whose body was
// not stored: from rec.Response.Ref (a resource reference the handler recorded with
// SetRef) or from the request itself (marker mode). It writes the answer to w; the
// middleware has already set Idempotent-Replayed: true. An error makes the answer
// a 500 problem (idempotency_replay_failed).
type ReplayFunc func(w http.ResponseWriter, r *http.Request, rec *Record) error

// Config configures the middleware. A nil *Config means all defaults. New copies
// and validates it; the caller's struct is never modified.
type Config struct {
	// HeaderName is the request header that carries the key: a header field
	// name (RFC 9110 token), neither Host nor a hop-by-hop header, which a
	// handler never sees. Defaults to "Idempotency-Key".
	HeaderName string

	// Methods are the request methods that are keyed; others pass straight through.
	// Each must be a method name (an RFC 9110 token); an empty, non-nil list is
	// refused, as it would key nothing. Defaults (nil) to POST and PATCH.
	Methods []string

	// KeyOptional lets keyed requests without a key through, unprotected. When
	// false, a keyed request without the header is answered 400
	// (idempotency_key_missing). Defaults to false: the key is required.
	KeyOptional bool

	// MaxKeyLength is the longest key accepted, in bytes; longer keys get 400.
	// It may be lowered, not raised: every store indexes keys of up to 255 bytes.
	// Defaults to 255.
	MaxKeyLength int

	// ScopeFunc returns the tenant or principal a request belongs to. Records are
	// identified by (scope, key), so tenants never share keys. Defaults to
	// ScopeFromContext, which reads what an authentication middleware stored with
	// WithScope.
	ScopeFunc func(r *http.Request) string

	// FingerprintFunc computes the request fingerprint compared on every retry.
	// Defaults to FingerprintV3 (method, escaped path, query string and body,
	// SHA-256).
	FingerprintFunc FingerprintFunc

	// Lease is how long a claim stays in flight without renewal. The middleware
	// renews it every Lease/3 while the handler runs; a holder that crashes is taken
	// over once it lapses. Defaults to 30 seconds.
	Lease time.Duration

	// TTL is how long a record counts after it was claimed and after it completed;
	// it must outlive the longest retry window of any client. Defaults to 24 hours.
	TTL time.Duration

	// MaxRequestBody is the largest request body read for fingerprinting; larger
	// bodies get 413 (idempotency_body_too_large). Defaults to 1 MiB.
	MaxRequestBody int64

	// MaxStoredBody is the largest response body kept for replay. A larger response
	// is never replayed truncated: with a TxStore the transaction rolls back and the
	// client gets 500 (idempotency_response_too_large); otherwise the first caller
	// gets the full response and retries get that problem. Defaults to 1 MiB.
	MaxStoredBody int

	// StoredHeaders are the response headers kept and replayed. Set-Cookie,
	// hop-by-hop headers (Connection, Keep-Alive, Transfer-Encoding, Upgrade,
	// TE, Trailer, Proxy-*) and names that are not header field names are
	// refused. Defaults (nil) to DefaultStoredHeaders; an empty list keeps none.
	StoredHeaders []string

	// KeepFunc decides whether an outcome with the given status is stored. An
	// outcome that is not stored releases the key (and rolls back the handler's
	// transaction with a TxStore), so a retry runs afresh. Defaults to keeping every
	// outcome, 4xx and 5xx included.
	KeepFunc func(status int) bool

	// ReplayFunc, when set, answers retries from a record whose body is not stored:
	// the resource reference the handler recorded with SetRef, or only the marker and
	// fingerprint. With it, response bodies are not stored (status, stored headers
	// and the reference are). Defaults to nil: full responses are stored and
	// replayed byte for byte.
	ReplayFunc ReplayFunc

	// Flow chooses claim-then-complete or the single-transaction flow.
	// Defaults to FlowAuto: the store's preferred flow (FlowPreferrer), else
	// FlowClaimComplete.
	Flow Flow

	// NowFunc is the clock. Defaults to time.Now.
	NowFunc func() time.Time

	// Observer is told about every decision the middleware makes. Defaults to nil.
	Observer Observer

	// CleanupTimeout bounds the store calls made after the handler returned
	// (complete, release, commit), which do not stop when the client disconnects.
	// Defaults to 10 seconds.
	CleanupTimeout time.Duration
	// HandlerTimeout bounds how long the handler of a claimed request runs. Once a
	// request holds its key, its operation runs to its end whatever the client
	// does: the handler's context keeps the request's values but not the client's
	// cancellation, so a client that hangs up or times out does not abort the work
	// (or roll back its transaction), and its retry hears the stored outcome. The
	// handler's context ends HandlerTimeout after the handler started (its Err is
	// then context.DeadlineExceeded; a context the handler derives from it reports
	// context.Canceled, with context.Cause DeadlineExceeded), or when the lease is
	// lost (context.Cause is then ErrLockLost). When the handler runs in
	// the store's transaction (a TxStore or SingleTxStore), that transaction ends
	// with the context: a handler that returns after it ended, even one that
	// ignored it, commits nothing, and the request is answered 503
	// idempotency_commit_failed (or 409 idempotency_lease_lost) with the key
	// released. A negative value sets no deadline. Defaults to 1 minute.
	HandlerTimeout time.Duration

	// LapsedLease decides what a request gets when it finds its key in flight
	// with a lapsed lease: the holder crashed, stalled, or reported with
	// MarkOutcomeUnknown that it cannot know whether its operation took effect.
	// Defaults to LapsedTakeOver: take the key over and run the handler again.
	// LapsedRefuse answers 503 (idempotency_outcome_unknown) instead, until an
	// operator resolves the key (idem resolve).
	LapsedLease LapsedLease

	// InFlightWait, when positive, makes a request that finds its key in
	// flight, held by a request with the same fingerprint, wait up to this long
	// for the holder's outcome, and answers it with the replay
	// (Idempotent-Replayed: true) instead of 409. When the wait ends first it
	// gets the 409, with Retry-After for what is left of the lease. A different
	// request with the key gets 422 at once; a holder that lets go without an
	// outcome (released, lapsed) wakes its waiters, which go on as fresh
	// requests. Waiters in other processes are woken through the store
	// (OutcomeNotifier) or by polling it. A waiting request holds no store
	// connection, and stops at once when its client hangs up. Defaults to 0:
	// 409 at once. In the single-transaction flow the holder's fingerprint is
	// not known until it commits: a different request waits, then gets 422.
	InFlightWait time.Duration
	// InFlightMaxWaiters caps the requests waiting (InFlightWait) at once in
	// this middleware; beyond it a request gets 409 without waiting. Defaults to
	// DefaultInFlightMaxWaiters (10000).
	InFlightMaxWaiters int
	// InFlightMaxWaitersPerKey caps the requests waiting for one key at once in
	// this middleware; beyond it a request gets 409 without waiting. Defaults to
	// DefaultInFlightMaxWaitersPerKey (1000).
	InFlightMaxWaitersPerKey int
}

// LapsedLease is the policy for an in-flight record whose lease lapsed.
type LapsedLease uint8

const (
	// LapsedTakeOver, the zero value, takes the key over with a fresh claim and
	// runs the handler again. The holder that lapsed can no longer complete.
	// Choose it when running the operation twice is harmless, or when the
	// handler's effects commit with the stored outcome (a SQL TxStore).
	LapsedTakeOver LapsedLease = iota
	// LapsedRefuse answers 503 (idempotency_outcome_unknown) to every request
	// with the key, and leaves the record in flight with its lease lapsed, until
	// an operator completes it with an answer or releases it (idem resolve), or
	// it expires at its TTL. A refusal writes nothing: a holder that was only
	// stalled may still complete, and its outcome is then replayed.
	LapsedRefuse
)

// String returns "take-over" or "refuse".
func (l LapsedLease) String() string {
	switch l {
	case LapsedTakeOver:
		return "take-over"
	case LapsedRefuse:
		return "refuse"
	}
	return fmt.Sprintf("LapsedLease(%d)", uint8(l))
}

// EventKind names a decision of the middleware.
type EventKind uint8

// The events an Observer sees.
const (
	EventExecuted   EventKind = iota + 1 // the handler ran and its outcome was stored
	EventReplayed                        // a stored outcome was replayed
	EventInFlight                        // 409: the key is held by another request
	EventMismatch                        // 422: the key was reused with another request
	EventRejected                        // 400 or 413 before the store was touched
	EventStoreError                      // the store failed; Err says how
	EventLeaseLost                       // the lease was lost while the handler ran
	EventReleased                        // the key was released (panic, not kept, failed commit)
	EventTakenOver                       // a lapsed lease was taken over
	// EventClaimed: the request took the key (a fresh claim, a takeover, or the
	// single-transaction flow's lock) and its handler is about to run. Only an
	// Observer that implements ClaimObserver, with ObservesClaims true, sees it;
	// the one later event of the same request that ends its hold on the key has
	// Claimed set, so that together they count the claims held right now.
	EventClaimed
	// EventWaited: a wait for the holder's outcome (Config.InFlightWait)
	// ended; Wait says how and Waited how long it took. It comes before the
	// event of the request's answer (a wait that ends in WaitRetried may be
	// followed by another wait).
	EventWaited
)

var eventNames = [...]string{"", "executed", "replayed", "in_flight", "mismatch", "rejected", "store_error", "lease_lost", "released", "taken_over", "claimed", "waited"}

// String returns the event's snake_case name.
func (k EventKind) String() string {
	if int(k) < len(eventNames) {
		return eventNames[k]
	}
	return "unknown"
}

// Event describes one decision of the middleware.
type Event struct {
	Kind   EventKind
	Scope  string
	Key    string
	Status int           // the status sent, when one was
	Err    error         // the error behind the event, if any
	Took   time.Duration // time since the request reached the middleware
	// Claimed is set on the last event of a request that took the key (after its
	// EventClaimed): the event that ends its hold on the key, whatever its Kind.
	Claimed bool
	// Wait is how the wait of an EventWaited ended; zero on other events.
	Wait WaitOutcome
	// Waited is how long the wait of an EventWaited took, on the wall clock.
	Waited time.Duration
}

// Observer receives events. Observe is called synchronously on the request's
// goroutine (never from the lease renewal) and must not block.
type Observer interface {
	Observe(ctx context.Context, e Event)
}

// ClaimObserver is an Observer that also wants EventClaimed, for example to keep
// a gauge of the claims held by this process: add one on EventClaimed, take one
// away on every event with Claimed set. New asks ObservesClaims once.
type ClaimObserver interface {
	Observer
	ObservesClaims() bool
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(ctx context.Context, e Event)

// Observe calls f.
func (f ObserverFunc) Observe(ctx context.Context, e Event) { f(ctx, e) }

// settings is a validated Config with defaults applied.
type settings struct {
	Config
	keyed         map[string]bool
	storedHdrs    []string // canonical
	observeClaims bool     // the Observer wants EventClaimed
	wallClock     bool     // NowFunc is time.Now: a record time is a wall clock reading too
	defaultFP     bool     // FingerprintFunc is the default, FingerprintV3: computed into the request's own memory
}

// Validate reports what is wrong with c, as New would, without needing a store.
// Settings that depend on the store (FlowSingleTx needs a SingleTxStore) are
// checked by New.
func (c *Config) Validate() error {
	_, err := c.check(nil, true)
	return err
}

func (c *Config) settings(store Store) (*settings, error) { return c.check(store, false) }

func (c *Config) check(store Store, validateOnly bool) (*settings, error) {
	s := &settings{}
	if c != nil {
		s.Config = *c
	}
	cfg := &s.Config
	var errs []error
	if cfg.HeaderName == "" {
		cfg.HeaderName = DefaultHeaderName
	}
	cfg.HeaderName = http.CanonicalHeaderKey(cfg.HeaderName)
	if !validFieldName(cfg.HeaderName) {
		errs = append(errs, fmt.Errorf("invalid HeaderName %q: not a header field name (letters, digits and !#$%%&'*+-.^_`|~ only); leave it empty for %q", cfg.HeaderName, DefaultHeaderName))
	} else if why, bad := unkeyableHeaders[cfg.HeaderName]; bad {
		errs = append(errs, fmt.Errorf("invalid HeaderName %q: %s, so no key would ever be seen; leave it empty for %q", cfg.HeaderName, why, DefaultHeaderName))
	}
	if cfg.Methods == nil {
		cfg.Methods = DefaultMethods
	} else if len(cfg.Methods) == 0 {
		errs = append(errs, errors.New("invalid Methods: the list is empty, so no request would be keyed; list the methods to key, or leave it nil for POST and PATCH"))
	}
	s.keyed = make(map[string]bool, len(cfg.Methods))
	for _, m := range cfg.Methods {
		if !validFieldName(m) {
			errs = append(errs, fmt.Errorf("invalid Methods: %q is not a method name (an HTTP token such as POST), so no request would match it", m))
			continue
		}
		s.keyed[strings.ToUpper(m)] = true
	}
	if cfg.MaxKeyLength == 0 {
		cfg.MaxKeyLength = DefaultMaxKeyLength
	} else if cfg.MaxKeyLength < 0 || cfg.MaxKeyLength > DefaultMaxKeyLength {
		errs = append(errs, fmt.Errorf("invalid MaxKeyLength %d: use 1 to %d (the longest key every store indexes), or 0 for the default", cfg.MaxKeyLength, DefaultMaxKeyLength))
	}
	if cfg.ScopeFunc == nil {
		cfg.ScopeFunc = ScopeFromContext
	}
	if cfg.FingerprintFunc == nil {
		cfg.FingerprintFunc = FingerprintV3
		s.defaultFP = true
	}
	if cfg.Lease == 0 {
		cfg.Lease = DefaultLease
	} else if cfg.Lease < 10*time.Millisecond {
		errs = append(errs, fmt.Errorf("invalid Lease %v: use at least 10ms, or 0 for the default %v", cfg.Lease, DefaultLease))
	}
	if cfg.TTL == 0 {
		cfg.TTL = DefaultTTL
		if cfg.TTL < cfg.Lease {
			errs = append(errs, fmt.Errorf("invalid TTL: the default %v is shorter than Lease (%v); a record must outlive its lease, so set TTL to at least Lease", cfg.TTL, cfg.Lease))
		}
	} else if cfg.TTL < cfg.Lease {
		errs = append(errs, fmt.Errorf("invalid TTL %v: shorter than Lease (%v); a record must outlive its lease", cfg.TTL, cfg.Lease))
	}
	if cfg.MaxRequestBody == 0 {
		cfg.MaxRequestBody = DefaultMaxRequestBody
	} else if cfg.MaxRequestBody < 0 {
		errs = append(errs, fmt.Errorf("invalid MaxRequestBody %d: use a positive size or 0 for the default", cfg.MaxRequestBody))
	}
	if cfg.MaxStoredBody == 0 {
		cfg.MaxStoredBody = DefaultMaxStoredBody
	} else if cfg.MaxStoredBody < 0 {
		errs = append(errs, fmt.Errorf("invalid MaxStoredBody %d: use a positive size or 0 for the default", cfg.MaxStoredBody))
	}
	if cfg.StoredHeaders == nil {
		cfg.StoredHeaders = DefaultStoredHeaders
	}
	for _, h := range cfg.StoredHeaders {
		ch := http.CanonicalHeaderKey(h)
		switch {
		case ch == "Set-Cookie":
			errs = append(errs, errors.New("invalid StoredHeaders: it lists Set-Cookie; a replay must never hand one client's cookie to another attempt, remove it"))
			continue
		case !validFieldName(ch):
			errs = append(errs, fmt.Errorf("invalid StoredHeaders: %q is not a header field name (letters, digits and !#$%%&'*+-.^_`|~ only), so no response header would match it; remove it or correct it", h))
			continue
		case hopByHop[ch]:
			errs = append(errs, fmt.Errorf("invalid StoredHeaders: %s is a hop-by-hop header, about one connection, not the outcome; a replay must not send it again, remove it", ch))
			continue
		case slices.Contains(s.storedHdrs, ch):
			continue // listed twice: kept once
		}
		s.storedHdrs = append(s.storedHdrs, ch)
	}
	if cfg.KeepFunc == nil {
		cfg.KeepFunc = keepEverything
	}
	if cfg.NowFunc == nil {
		cfg.NowFunc = time.Now
		s.wallClock = true
	}
	if cfg.CleanupTimeout == 0 {
		cfg.CleanupTimeout = DefaultCleanupTimeout
	} else if cfg.CleanupTimeout < 0 {
		errs = append(errs, fmt.Errorf("invalid CleanupTimeout %v: use a positive duration, or 0 for the default %v", cfg.CleanupTimeout, DefaultCleanupTimeout))
	}
	if cfg.HandlerTimeout == 0 {
		cfg.HandlerTimeout = DefaultHandlerTimeout
	}
	if cfg.LapsedLease > LapsedRefuse {
		errs = append(errs, fmt.Errorf("invalid LapsedLease %d: use LapsedTakeOver or LapsedRefuse", cfg.LapsedLease))
	}
	if cfg.InFlightWait < 0 {
		errs = append(errs, fmt.Errorf("invalid InFlightWait %v: use a positive duration to wait for the holder's outcome, or 0 to answer 409 at once", cfg.InFlightWait))
	}
	if cfg.InFlightMaxWaiters == 0 {
		cfg.InFlightMaxWaiters = DefaultInFlightMaxWaiters
	} else if cfg.InFlightMaxWaiters < 0 {
		errs = append(errs, fmt.Errorf("invalid InFlightMaxWaiters %d: use a positive number, or 0 for the default %d", cfg.InFlightMaxWaiters, DefaultInFlightMaxWaiters))
	}
	if cfg.InFlightMaxWaitersPerKey == 0 {
		cfg.InFlightMaxWaitersPerKey = DefaultInFlightMaxWaitersPerKey
	} else if cfg.InFlightMaxWaitersPerKey < 0 {
		errs = append(errs, fmt.Errorf("invalid InFlightMaxWaitersPerKey %d: use a positive number, or 0 for the default %d", cfg.InFlightMaxWaitersPerKey, DefaultInFlightMaxWaitersPerKey))
	}
	if co, ok := cfg.Observer.(ClaimObserver); ok {
		s.observeClaims = co.ObservesClaims()
	}
	nilStore := isNil(store)
	if cfg.Flow == FlowAuto && !nilStore {
		cfg.Flow = FlowClaimComplete
		if p, ok := store.(FlowPreferrer); ok && p.PreferredFlow() == FlowSingleTx {
			if _, ok := store.(SingleTxStore); ok {
				cfg.Flow = FlowSingleTx
			}
		}
	}
	switch cfg.Flow {
	case FlowAuto, FlowClaimComplete:
	case FlowSingleTx:
		if _, ok := store.(SingleTxStore); !ok && !nilStore {
			errs = append(errs, fmt.Errorf("invalid Flow: FlowSingleTx needs an idem.SingleTxStore, and %T is not one; use pgstore, sqlitestore or mysqlstore, or FlowClaimComplete", store))
		}
	default:
		errs = append(errs, fmt.Errorf("invalid Flow %d: unknown; use FlowAuto, FlowClaimComplete or FlowSingleTx", cfg.Flow))
	}
	if nilStore && !validateOnly {
		errs = append(errs, fmt.Errorf("store is nil (%T); pass one, for example memstore.New(nil) or a SQL store, and check the error of the call that made it", store))
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("idem: invalid config: %w", errors.Join(errs...))
	}
	return s, nil
}

func keepEverything(int) bool { return true }

// isNil reports whether store is nil, or a nil pointer (or map, func, …) in an
// interface: what a constructor returns beside its error, and which would
// panic on the first request.
func isNil(store Store) bool {
	if store == nil {
		return true
	}
	switch v := reflect.ValueOf(store); v.Kind() {
	case reflect.Pointer, reflect.Map, reflect.Func, reflect.Chan, reflect.Interface, reflect.Slice:
		return v.IsNil()
	}
	return false
}

// validFieldName reports whether s is an RFC 9110 token: a valid header field
// name or method.
func validFieldName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == ':' || c == '/' || !tokenChar[c] {
			return false
		}
	}
	return true
}

// hopByHop are the header fields about one connection (RFC 9110 §7.6.1 and
// the ones proxies have always treated so): never part of an outcome.
var hopByHop = map[string]bool{
	"Connection": true, "Keep-Alive": true, "Proxy-Connection": true, "Te": true,
	"Trailer": true, "Transfer-Encoding": true, "Upgrade": true,
	"Proxy-Authenticate": true, "Proxy-Authorization": true,
}

// unkeyableHeaders are header names a handler never finds in Request.Header.
var unkeyableHeaders = map[string]string{
	"Host":              "net/http moves it out of Request.Header (into Request.Host)",
	"Transfer-Encoding": "it is hop-by-hop, and net/http moves it out of Request.Header",
	"Connection":        "it is hop-by-hop: proxies drop it",
	"Keep-Alive":        "it is hop-by-hop: proxies drop it",
	"Proxy-Connection":  "it is hop-by-hop: proxies drop it",
	"Te":                "it is hop-by-hop: proxies drop it",
	"Trailer":           "it is hop-by-hop: proxies drop it",
	"Upgrade":           "it is hop-by-hop: proxies drop it",
}
