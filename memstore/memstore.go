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
// Store keeps the *idem.Response passed to Complete without copying it and hands
// out the same *idem.Record to every reader: callers must not modify either.
type Store struct {
	latest atomic.Int64 // the latest clock reading passed in, in Unix nanoseconds
	seed   maphash.Seed
	shards [shardCount]shard
	stop   context.CancelFunc
	done   chan struct{}
}

type shard struct {
	mu      sync.Mutex
	records map[recordID]*idem.Record
}

type recordID struct{ scope, key string }

var _ idem.Store = (*Store)(nil)

// New returns an empty store and starts its janitor. Call Close to stop the janitor.
func New(cfg *Config) *Store {
	s := &Store{seed: maphash.MakeSeed()}
	for i := range s.shards {
		s.shards[i].records = make(map[recordID]*idem.Record)
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
		n += len(sh.records)
		sh.mu.Unlock()
	}
	return n
}

// seen notes a clock reading of the middleware's.
func (s *Store) seen(now time.Time) {
	n := now.UnixNano()
	for {
		old := s.latest.Load()
		if n <= old || s.latest.CompareAndSwap(old, n) {
			return
		}
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

func (s *Store) shard(scope, key string) *shard {
	var h maphash.Hash
	h.SetSeed(s.seed)
	h.WriteString(scope)
	h.WriteByte(0)
	h.WriteString(key)
	return &s.shards[h.Sum64()%shardCount]
}

// Claim implements idem.Store.
func (s *Store) Claim(_ context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	s.seen(req.Now)
	id := recordID{req.Scope, req.Key}
	sh := s.shard(req.Scope, req.Key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	created := req.Now
	if old, ok := sh.records[id]; ok && old.ExpiresAt.After(req.Now) {
		lapsed := old.State == idem.StateInFlight && !old.LeaseUntil.After(req.Now) && old.Fingerprint == req.Fingerprint
		if !lapsed {
			return old, false, nil
		}
		created = old.CreatedAt
	}
	rec := &idem.Record{
		Scope: req.Scope, Key: req.Key, State: idem.StateInFlight, Fingerprint: req.Fingerprint,
		Token: req.Token, CreatedAt: created, LeaseUntil: req.LeaseUntil, ExpiresAt: req.ExpiresAt,
	}
	sh.records[id] = rec
	return rec, true, nil
}

// held returns the in-flight record held under token, with its shard locked; the
// caller unlocks. It returns nil when the record is not in flight under token.
func (s *Store) held(scope, key, token string) (*shard, *idem.Record) {
	sh := s.shard(scope, key)
	sh.mu.Lock()
	rec, ok := sh.records[recordID{scope, key}]
	if !ok || rec.State != idem.StateInFlight || rec.Token != token {
		return sh, nil
	}
	return sh, rec
}

// Complete implements idem.Store.
func (s *Store) Complete(_ context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	s.seen(now)
	sh, rec := s.held(scope, key, token)
	defer sh.mu.Unlock()
	if rec == nil {
		return idem.ErrLockLost
	}
	done := *rec
	done.State = idem.StateComplete
	done.ExpiresAt = expiresAt
	done.Response = resp
	sh.records[recordID{scope, key}] = &done
	return nil
}

// Release implements idem.Store.
func (s *Store) Release(_ context.Context, scope, key, token string) error {
	sh, rec := s.held(scope, key, token)
	defer sh.mu.Unlock()
	if rec == nil {
		return idem.ErrLockLost
	}
	delete(sh.records, recordID{scope, key})
	return nil
}

// Extend implements idem.Store.
func (s *Store) Extend(_ context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	s.seen(now)
	sh, rec := s.held(scope, key, token)
	defer sh.mu.Unlock()
	if rec == nil {
		return idem.ErrLockLost
	}
	ext := *rec
	ext.LeaseUntil = leaseUntil
	if ext.ExpiresAt.Before(leaseUntil) {
		ext.ExpiresAt = leaseUntil
	}
	sh.records[recordID{scope, key}] = &ext
	return nil
}

// Get implements idem.Store.
func (s *Store) Get(_ context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	sh := s.shard(scope, key)
	sh.mu.Lock()
	defer sh.mu.Unlock()
	rec, ok := sh.records[recordID{scope, key}]
	if !ok || !rec.ExpiresAt.After(now) {
		return nil, idem.ErrNotFound
	}
	return rec, nil
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
		for id, rec := range sh.records {
			if deleted >= limit {
				break
			}
			if !rec.ExpiresAt.After(now) {
				delete(sh.records, id)
				deleted++
			}
		}
		sh.mu.Unlock()
	}
	return deleted, nil
}
