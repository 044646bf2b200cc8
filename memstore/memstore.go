// Package memstore is an in-memory idem.Store for tests and single-process
// services. Records live in a sharded map and vanish with the process; a janitor
// goroutine deletes expired ones.
//
// It is correct under any concurrency (every method is one step under one shard's
// lock) and fast, but it cannot share keys between processes and does not survive
// a restart: use a SQL store or redisstore for that.
package memstore

import (
	"context"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/wakehub"
)

const shardCount = 64

// Config configures a Store. A nil *Config means all defaults.
type Config struct {
	// JanitorInterval is how often the background janitor deletes expired records.
	// A negative value starts no janitor (call DeleteExpired yourself).
	// Defaults to one minute.
	JanitorInterval time.Duration
	// NowFunc is the janitor's clock. Defaults to the latest clock reading the
	// middleware passed to the store (its Config.NowFunc), so that the janitor
	// never runs ahead of the clock the records were written by; before any
	// reading it deletes nothing.
	NowFunc func() time.Time
}

// Store is an in-memory idem.Store. Its zero value is not usable; call New.
//
// Store keeps each record as one pointer-free byte slice, so that the garbage
// collector does not scan what it keeps. The records it hands out share that
// memory for their strings and body: callers must not modify them.
type Store struct {
	latest atomic.Int64 // the latest clock reading passed in, in Unix nanoseconds
	seed   maphash.Seed
	shards [shardCount]shard
	stop   context.CancelFunc
	done   chan struct{}
	hub    wakehub.Hub // waiters for outcomes (idem.OutcomeNotifier)
	steps  stepTable   // step records (idem.StepStore, steps.go)
}

// shard holds the blobs of its records by the 64-bit hash of (scope, key). The
// rare record whose hash another record already holds goes to overflow.
type shard struct {
	mu       sync.Mutex
	records  map[uint64][]byte
	overflow map[recordID][]byte
}

type recordID struct{ scope, key string }

// get returns the blob of (scope, key), or nil.
func (sh *shard) get(h uint64, scope, key string) []byte {
	b, _ := sh.find(h, scope, key)
	return b
}

// place is where find found a record, or where set puts one.
type place uint8

const (
	inRecords  place = iota // records[h]: the record, or a free slot for it
	inOverflow              // overflow: the record, or where it goes (records[h] holds another)
)

// find returns the blob of (scope, key), or nil, and where it is or would go,
// so that set stores its successor without looking it up again.
func (sh *shard) find(h uint64, scope, key string) ([]byte, place) {
	b := sh.records[h]
	if b != nil {
		if s, k := id(b); s == scope && k == key {
			return b, inRecords
		}
	}
	if len(sh.overflow) > 0 {
		// A record goes to overflow when records[h] holds another, which
		// may have been removed since.
		if o, ok := sh.overflow[recordID{scope, key}]; ok {
			return o, inOverflow
		}
	}
	if b == nil {
		return nil, inRecords
	}
	return nil, inOverflow
}

// set stores b as the blob of (scope, key) at p, what find returned for it
// under the same lock.
func (sh *shard) set(h uint64, scope, key string, b []byte, p place) {
	if p == inRecords {
		sh.records[h] = b
		return
	}
	if sh.overflow == nil {
		sh.overflow = make(map[recordID][]byte)
	}
	sh.overflow[recordID{scope, key}] = b
}

// remove deletes the blob of (scope, key).
func (sh *shard) remove(h uint64, scope, key string) {
	if b := sh.records[h]; b != nil {
		if s, k := id(b); s == scope && k == key {
			delete(sh.records, h)
			return
		}
	}
	delete(sh.overflow, recordID{scope, key})
}

var _ idem.Store = (*Store)(nil)

// New returns an empty store and starts its janitor. Call Close to stop the janitor.
func New(cfg *Config) *Store {
	s := &Store{seed: maphash.MakeSeed()}
	for i := range s.shards {
		s.shards[i].records = make(map[uint64][]byte)
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.JanitorInterval == 0 {
		c.JanitorInterval = time.Minute
	}
	if c.JanitorInterval > 0 {
		ctx, cancel := context.WithCancel(context.Background())
		s.stop, s.done = cancel, make(chan struct{})
		now := c.NowFunc
		if now == nil {
			now = s.clock
		}
		j := &idem.Janitor{Store: s, Interval: c.JanitorInterval, NowFunc: now}
		go func() {
			defer close(s.done)
			_ = j.Run(ctx)
		}()
	}
	return s
}

// Close stops the janitor. The records stay readable.
func (s *Store) Close() error {
	if s.stop != nil {
		s.stop()
		<-s.done
		s.stop = nil
	}
	return nil
}

// Len returns the number of records held, expired ones included.
func (s *Store) Len() int {
	n := 0
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		n += len(sh.records) + len(sh.overflow)
		sh.mu.Unlock()
	}
	return n
}

// seen notes a clock reading of the middleware's. The latest reading wins, not
// the highest: a clock that jumped ahead once and came back must not leave the
// janitor ahead, deleting every record it writes afterwards. Concurrent calls
// may leave a reading a moment older than another's, which only delays a sweep.
func (s *Store) seen(now time.Time) {
	if n := unixNanos(now); s.latest.Load() != n {
		s.latest.Store(n)
	}
}

// clock returns the latest clock reading the middleware passed in, or the zero
// time before any.
func (s *Store) clock() time.Time {
	if n := s.latest.Load(); n != 0 {
		return time.Unix(0, n)
	}
	return time.Time{}
}

// shard returns the shard of (scope, key) and the key's hash within it.
func (s *Store) shard(scope, key string) (*shard, uint64) {
	var h maphash.Hash
	h.SetSeed(s.seed)
	h.WriteString(scope)
	h.WriteByte(0)
	h.WriteString(key)
	sum := h.Sum64()
	return &s.shards[sum%shardCount], sum
}

// Claim implements idem.Store.
func (s *Store) Claim(_ context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	s.seen(req.Now)
	sh, h := s.shard(req.Scope, req.Key)
	now := unixNanos(req.Now)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	created := req.Now
	old, p := sh.find(h, req.Scope, req.Key)
	if old != nil && getNanos(old, offExpires) > now {
		lapsed := state(old) == idem.StateInFlight && getNanos(old, offLease) <= now && fpMatches(storedFP(old), req.Fingerprint)
		if !lapsed {
			return decode(old, req.Fingerprint), false, nil
		}
		created = getTime(old, offCreated)
	}
	var fp [80]byte
	sh.set(h, req.Scope, req.Key, encode(idem.StateInFlight, req.Scope, req.Key, packFP(fp[:0], req.Fingerprint), req.Token, created, req.LeaseUntil, req.ExpiresAt, nil), p)
	return &idem.Record{
		Scope: req.Scope, Key: req.Key, State: idem.StateInFlight, Fingerprint: req.Fingerprint,
		Token: req.Token, CreatedAt: created, LeaseUntil: req.LeaseUntil, ExpiresAt: req.ExpiresAt,
	}, true, nil
}

// held returns the blob of the in-flight record held under token, with its shard
// locked, where it is (for set), and its stored fingerprint; the caller
// unlocks. The blob is nil when the record is not in flight under token.
func (s *Store) held(scope, key, token string) (*shard, uint64, []byte, place, []byte) {
	sh, h := s.shard(scope, key)
	sh.mu.Lock()
	b, p := sh.find(h, scope, key)
	if b == nil || state(b) != idem.StateInFlight {
		return sh, h, nil, p, nil
	}
	fp, tok := fpAndToken(b)
	if tok != token {
		return sh, h, nil, p, nil
	}
	return sh, h, b, p, fp
}

// Complete implements idem.Store. The response is copied into the record.
func (s *Store) Complete(_ context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	s.seen(now)
	sh, h, b, p, fp := s.held(scope, key, token)
	defer sh.mu.Unlock()
	if b == nil {
		return idem.ErrLockLost
	}
	// The token fences nothing once the record is complete: it is not kept.
	sh.set(h, scope, key, encode(idem.StateComplete, scope, key, fp, "", getTime(b, offCreated), getTime(b, offLease), expiresAt, resp), p)
	return nil
}

// Release implements idem.Store.
func (s *Store) Release(_ context.Context, scope, key, token string) error {
	sh, h, b, _, _ := s.held(scope, key, token)
	defer sh.mu.Unlock()
	if b == nil {
		return idem.ErrLockLost
	}
	sh.remove(h, scope, key)
	return nil
}

// Extend implements idem.Store. It changes only the times of the record's fixed
// part, which readers copy under the lock.
func (s *Store) Extend(_ context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	s.seen(now)
	sh, _, b, _, _ := s.held(scope, key, token)
	defer sh.mu.Unlock()
	if b == nil {
		return idem.ErrLockLost
	}
	putTime(b, offLease, leaseUntil)
	if getNanos(b, offExpires) < unixNanos(leaseUntil) {
		putTime(b, offExpires, leaseUntil)
	}
	return nil
}

// Get implements idem.Store. The record's strings and body share the store's
// memory: callers must not modify them.
func (s *Store) Get(_ context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	sh, h := s.shard(scope, key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	b := sh.get(h, scope, key)
	if b == nil || getNanos(b, offExpires) <= unixNanos(now) {
		return nil, idem.ErrNotFound
	}
	return decode(b, ""), nil
}

// DeleteExpired implements idem.Store. It holds one shard's lock at a time.
func (s *Store) DeleteExpired(ctx context.Context, now time.Time, limit int) (int, error) {
	deleted := 0
	for i := range s.shards {
		if deleted >= limit {
			break
		}
		if err := ctx.Err(); err != nil {
			return deleted, err
		}
		sh := &s.shards[i]
		sh.mu.Lock()
		cutoff := unixNanos(now)
		for h, b := range sh.records {
			if deleted >= limit {
				break
			}
			if getNanos(b, offExpires) <= cutoff {
				delete(sh.records, h)
				deleted++
			}
		}
		for id, b := range sh.overflow {
			if deleted >= limit {
				break
			}
			if getNanos(b, offExpires) <= cutoff {
				delete(sh.overflow, id)
				deleted++
			}
		}
		sh.mu.Unlock()
	}
	return deleted, nil
}

// CopiesResponses implements idem.ResponseCopier: Complete encodes the response
// into the record's own memory.
func (s *Store) CopiesResponses() bool { return true }

// WatchOutcome watches (scope, key) for NotifyOutcome in this process: the
// waiters of every middleware sharing the store are woken. It implements
// idem.OutcomeNotifier.
func (s *Store) WatchOutcome(_ context.Context, scope, key string) (<-chan struct{}, func(), error) {
	ch, stop := s.hub.Watch(wakehub.ID(scope, key))
	return ch, stop, nil
}

// NotifyOutcome wakes the watchers of (scope, key). It implements
// idem.OutcomeNotifier.
func (s *Store) NotifyOutcome(_ context.Context, scope, key string) error {
	s.hub.Notify(wakehub.ID(scope, key))
	return nil
}
