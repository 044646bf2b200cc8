package storetest_test

import (
	"context"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/storetest"
)

// The conformance suite as a custom store's author uses it: storetest.Run
// against a store. A suite that passes a broken store is a bug in the suite,
// so each bug below is planted in a small store that is otherwise correct (it
// passes Run, TestRunPassesTheReferenceStore) and Run must fail on it, in the
// subtest that names the broken guarantee.

// bug names one planted fault.
type bug string

const (
	noBug                bug = ""
	checkThenWriteClaim  bug = "check-then-write-claim"    // reads, waits, then writes: two winners
	unfencedComplete     bug = "unfenced-complete"         // Complete ignores the token
	unfencedRelease      bug = "unfenced-release"          // Release ignores the token
	unfencedExtend       bug = "unfenced-extend"           // Extend ignores the token
	extendKeepsExpiry    bug = "extend-keeps-expiry"       // a live lease past the TTL expires
	extendShortensExpiry bug = "extend-shortens-expiry"    // Extend sets the expiry to the lease, even earlier
	takeoverAnyPrint     bug = "takeover-any-fingerprint"  // a lapsed lease is taken by another request
	takeoverComplete     bug = "takeover-complete"         // a complete record past its old lease is claimed again
	truncatedKeys        bug = "truncated-keys"            // keys cut to 64 bytes: long keys collide
	truncatedScopes      bug = "truncated-scopes"          // scopes cut to 64 bytes
	getExpired           bug = "get-expired"               // Get returns expired records
	janitorDeletesLive   bug = "janitor-deletes-in-flight" // DeleteExpired deletes in-flight records past their claim's TTL
	janitorByLease       bug = "janitor-by-lease"          // DeleteExpired deletes records whose lease has passed
	sharedResponse       bug = "shared-response"           // says it copies responses, keeps the caller's
	completeKeepsExpiry  bug = "complete-keeps-expiry"     // Complete ignores expiresAt
	takeoverNewCreatedAt bug = "takeover-new-created-at"   // a takeover resets CreatedAt

	// Bugs of the transactional stores (refTxStore).
	unfencedTxComplete bug = "unfenced-tx-complete"  // Tx.Complete and Commit ignore the token
	txCompleteAtOnce   bug = "tx-complete-at-once"   // Tx.Complete writes at once: a rollback keeps it
	noKeyLock          bug = "no-key-lock"           // BeginLocked never reports ErrInFlight
	lockKeptOnRollback bug = "lock-kept-on-rollback" // Rollback of a LockedTx leaves the key locked
)

// txBugs are the bugs planted in refTxStore rather than refStore.
var txBugs = map[bug]bool{unfencedTxComplete: true, txCompleteAtOnce: true, noKeyLock: true, lockKeptOnRollback: true}

// refTxStore is refStore with a transactional completion (idem.TxStore) and
// the single-transaction flow (idem.SingleTxStore): a transaction applies its
// writes under the store's lock at Commit.
type refTxStore struct {
	*refStore
	locked map[[2]string]bool // keys held by a LockedTx; guarded by mu
}

func newRefTxStore(b bug) *refTxStore {
	return &refTxStore{refStore: newRefStore(b), locked: map[[2]string]bool{}}
}

type refTx struct {
	s       *refTxStore
	pending []func() error // run under s.mu at Commit
	done    bool
}

func (s *refTxStore) BeginTx(ctx context.Context) (context.Context, idem.Tx, error) {
	return ctx, &refTx{s: s}, nil
}

func (tx *refTx) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	s := tx.s
	fenced := s.bug != unfencedTxComplete
	resp = copyResponse(resp)
	apply := func() error {
		rec := s.held(scope, key, token, fenced)
		if rec == nil {
			return idem.ErrLockLost
		}
		rec.State, rec.Token, rec.ExpiresAt, rec.Response = idem.StateComplete, "", expiresAt, resp
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bug == txCompleteAtOnce {
		return apply()
	}
	if s.held(scope, key, token, fenced) == nil {
		return idem.ErrLockLost
	}
	tx.pending = append(tx.pending, apply)
	return nil
}

func (tx *refTx) Commit(ctx context.Context) error {
	tx.s.mu.Lock()
	defer tx.s.mu.Unlock()
	if tx.done {
		return nil
	}
	tx.done = true
	for _, f := range tx.pending {
		if err := f(); err != nil {
			return err // one write per transaction here: all or nothing
		}
	}
	return nil
}

func (tx *refTx) Rollback(ctx context.Context) error {
	tx.s.mu.Lock()
	tx.done = true
	tx.s.mu.Unlock()
	return nil
}

type refLockedTx struct {
	refTx
	id     [2]string
	insert *idem.Record
}

func (s *refTxStore) BeginLocked(ctx context.Context, scope, key string, now time.Time) (context.Context, idem.LockedTx, *idem.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	id := s.id(scope, key)
	if s.locked[id] && s.bug != noKeyLock {
		return ctx, nil, nil, idem.ErrInFlight
	}
	s.locked[id] = true
	tx := &refLockedTx{refTx: refTx{s: s}, id: id}
	if rec := s.m[id]; rec != nil && rec.ExpiresAt.After(now) {
		return ctx, tx, copyRecord(rec), nil
	}
	return ctx, tx, nil, nil
}

func (tx *refLockedTx) Insert(ctx context.Context, rec *idem.Record) error {
	tx.insert = copyRecord(rec)
	return nil
}

func (tx *refLockedTx) Commit(ctx context.Context) error {
	s := tx.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if tx.done {
		return nil
	}
	tx.done = true
	delete(s.locked, tx.id)
	if tx.insert != nil {
		if old := s.m[tx.id]; old != nil && old.ExpiresAt.After(tx.insert.CreatedAt) {
			return idem.ErrInFlight
		}
		s.m[tx.id] = tx.insert
	}
	return nil
}

func (tx *refLockedTx) Rollback(ctx context.Context) error {
	s := tx.s
	s.mu.Lock()
	defer s.mu.Unlock()
	if !tx.done && s.bug != lockKeptOnRollback {
		delete(s.locked, tx.id)
	}
	tx.done = true
	return nil
}

// refStore is a plain, mutex-guarded implementation of idem.Store, with one
// planted bug (or none).
type refStore struct {
	bug bug
	mu  sync.Mutex
	m   map[[2]string]*idem.Record
}

func newRefStore(b bug) *refStore { return &refStore{bug: b, m: map[[2]string]*idem.Record{}} }

func (s *refStore) id(scope, key string) [2]string {
	if s.bug == truncatedKeys && len(key) > 64 {
		key = key[:64]
	}
	if s.bug == truncatedScopes && len(scope) > 64 {
		scope = scope[:64]
	}
	return [2]string{scope, key}
}

func copyResponse(r *idem.Response) *idem.Response {
	if r == nil {
		return nil
	}
	c := *r
	if r.Header != nil {
		c.Header = make(map[string][]string, len(r.Header))
		for k, v := range r.Header {
			c.Header[k] = slices.Clone(v)
		}
	}
	if r.Body != nil {
		c.Body = slices.Clone(r.Body)
	}
	return &c
}

func copyRecord(r *idem.Record) *idem.Record {
	c := *r
	c.Response = copyResponse(r.Response)
	return &c
}

func (s *refStore) CopiesResponses() bool { return true }

func (s *refStore) live(rec *idem.Record, now time.Time) bool {
	return rec != nil && (s.bug == getExpired || rec.ExpiresAt.After(now))
}

func (s *refStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if s.bug == checkThenWriteClaim {
		s.mu.Lock()
		rec := s.m[s.id(req.Scope, req.Key)]
		s.mu.Unlock()
		if rec == nil || !rec.ExpiresAt.After(req.Now) {
			time.Sleep(200 * time.Microsecond) // the window between the check and the write
			s.mu.Lock()
			defer s.mu.Unlock()
			n := &idem.Record{Scope: req.Scope, Key: req.Key, State: idem.StateInFlight, Fingerprint: req.Fingerprint,
				Token: req.Token, CreatedAt: req.Now, LeaseUntil: req.LeaseUntil, ExpiresAt: req.ExpiresAt}
			s.m[s.id(req.Scope, req.Key)] = n
			return copyRecord(n), true, nil
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	id := s.id(req.Scope, req.Key)
	rec := s.m[id]
	if rec != nil && !rec.ExpiresAt.After(req.Now) {
		rec = nil // expired: absent
	}
	if rec == nil {
		n := &idem.Record{Scope: req.Scope, Key: req.Key, State: idem.StateInFlight, Fingerprint: req.Fingerprint,
			Token: req.Token, CreatedAt: req.Now, LeaseUntil: req.LeaseUntil, ExpiresAt: req.ExpiresAt}
		s.m[id] = n
		return copyRecord(n), true, nil
	}
	inFlight := rec.State == idem.StateInFlight || s.bug == takeoverComplete
	samePrint := rec.Fingerprint == req.Fingerprint || s.bug == takeoverAnyPrint
	if inFlight && samePrint && !rec.LeaseUntil.After(req.Now) {
		rec.State, rec.Token, rec.LeaseUntil, rec.ExpiresAt, rec.Response = idem.StateInFlight, req.Token, req.LeaseUntil, req.ExpiresAt, nil
		rec.Fingerprint = req.Fingerprint
		if s.bug == takeoverNewCreatedAt {
			rec.CreatedAt = req.Now
		}
		return copyRecord(rec), true, nil
	}
	return copyRecord(rec), false, nil
}

// held returns the in-flight record held under token, or nil.
func (s *refStore) held(scope, key, token string, fenced bool) *idem.Record {
	rec := s.m[s.id(scope, key)]
	if rec == nil || rec.State != idem.StateInFlight || (fenced && rec.Token != token) {
		return nil
	}
	return rec
}

func (s *refStore) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec := s.held(scope, key, token, s.bug != unfencedComplete)
	if rec == nil {
		return idem.ErrLockLost
	}
	rec.State, rec.Token = idem.StateComplete, ""
	if s.bug != completeKeepsExpiry {
		rec.ExpiresAt = expiresAt
	}
	if s.bug == sharedResponse {
		rec.Response = resp
	} else {
		rec.Response = copyResponse(resp)
	}
	return nil
}

func (s *refStore) Release(ctx context.Context, scope, key, token string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held(scope, key, token, s.bug != unfencedRelease) == nil {
		return idem.ErrLockLost
	}
	delete(s.m, s.id(scope, key))
	return nil
}

func (s *refStore) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec := s.held(scope, key, token, s.bug != unfencedExtend)
	if rec == nil {
		return idem.ErrLockLost
	}
	rec.LeaseUntil = leaseUntil
	switch {
	case s.bug == extendKeepsExpiry:
	case s.bug == extendShortensExpiry:
		rec.ExpiresAt = leaseUntil
	case rec.ExpiresAt.Before(leaseUntil):
		rec.ExpiresAt = leaseUntil
	}
	return nil
}

func (s *refStore) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rec := s.m[s.id(scope, key)]
	if !s.live(rec, now) {
		return nil, idem.ErrNotFound
	}
	return copyRecord(rec), nil
}

func (s *refStore) DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, id := range slices.Collect(maps.Keys(s.m)) {
		if n == limit {
			break
		}
		rec := s.m[id]
		if !rec.ExpiresAt.After(now) || (s.bug == janitorByLease && !rec.LeaseUntil.After(now)) || (s.bug == janitorDeletesLive && rec.State == idem.StateInFlight && !rec.CreatedAt.Add(250*time.Millisecond).After(now)) {
			delete(s.m, id)
			n++
		}
	}
	return n, nil
}

// brokenEnv names the planted bug the child process runs the suite against.
const brokenEnv = "IDEM_STORETEST_PLANTED_BUG"

// TestRunOnPlantedBug is the child: it runs storetest.Run, as a store's author
// does, against the store with the bug the parent names.
func TestRunOnPlantedBug(t *testing.T) {
	b, ok := os.LookupEnv(brokenEnv)
	if !ok {
		t.Skip("run by TestRunCatchesPlantedBugs")
	}
	if txBugs[bug(b)] {
		storetest.Run(t, func(t *testing.T) idem.Store { return newRefTxStore(bug(b)) })
		return
	}
	storetest.Run(t, func(t *testing.T) idem.Store { return newRefStore(bug(b)) })
}

// TestRunPassesTheReferenceStore: without a bug the store is correct, so the
// failures below are the bugs'.
func TestRunPassesTheReferenceStore(t *testing.T) {
	t.Parallel()
	t.Run("plain", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) idem.Store { return newRefStore(noBug) })
	})
	t.Run("transactional", func(t *testing.T) {
		storetest.Run(t, func(t *testing.T) idem.Store { return newRefTxStore(noBug) })
	})
}

func TestRunCatchesPlantedBugs(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("runs the suite once per planted bug")
	}
	cases := map[bug][]string{ // the subtests that must fail (any of them)
		checkThenWriteClaim:  {"ClaimRace", "TakeoverRace", "Linearizable"},
		unfencedComplete:     {"StaleToken"},
		unfencedRelease:      {"StaleToken"},
		unfencedExtend:       {"StaleToken"},
		extendKeepsExpiry:    {"LiveLeasePastTTL"},
		extendShortensExpiry: {"Extend", "Linearizable"},
		takeoverAnyPrint:     {"LapsedLeaseOtherFingerprint"},
		takeoverComplete:     {"CompleteAndReplay", "Linearizable"},
		truncatedKeys:        {"LongKeysDistinct"},
		truncatedScopes:      {"LongKeysDistinct"},
		getExpired:           {"ExpiredReclaimed"},
		janitorDeletesLive:   {"LiveLeasePastTTL"},
		janitorByLease:       {"Janitor"},
		sharedResponse:       {"ResponseCopied"},
		completeKeepsExpiry:  {"CompleteAndReplay"},
		takeoverNewCreatedAt: {"LapsedLeaseTakenOver"},
		unfencedTxComplete:   {"TxComplete"},
		txCompleteAtOnce:     {"TxComplete"},
		noKeyLock:            {"SingleTxLock"},
		lockKeptOnRollback:   {"SingleTxLock"},
	}
	for b, want := range cases {
		t.Run(string(b), func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestRunOnPlantedBug$", "-test.count=1", "-test.v")
			cmd.Env = append(os.Environ(), brokenEnv+"="+string(b))
			out, err := cmd.CombinedOutput()
			if err == nil {
				t.Fatalf("storetest.Run passed a store whose %s:\n%s", b, tail(out))
			}
			for _, name := range want {
				if strings.Contains(string(out), "--- FAIL: TestRunOnPlantedBug/"+name+" ") || strings.Contains(string(out), "--- FAIL: TestRunOnPlantedBug/"+name+"/") {
					return
				}
			}
			t.Errorf("storetest.Run failed, but not in %v:\n%s", want, tail(out))
		})
	}
}

func tail(out []byte) string {
	lines := strings.Split(string(out), "\n")
	var keep []string
	for _, l := range lines {
		if strings.Contains(l, "--- FAIL") || strings.Contains(l, "panic") {
			keep = append(keep, l)
		}
	}
	if len(keep) == 0 && len(lines) > 20 {
		keep = lines[len(lines)-20:]
	}
	return strings.Join(keep, "\n")
}
