package memstore

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem"
)

// Step records (idem.StepStore) live in a map of their own, under one lock,
// apart from the request records: a handler's steps are few, and a step call
// is rare next to the claims and completions of every request. A BeginStep
// fenced on the request record (Holder) holds that record's shard lock while
// it decides, so that no takeover of the record comes between the check and
// the write; the lock order is always shard, then steps. The records are
// kept by operation, then by name: an execution's first BeginStep (First)
// and GetSteps look at the operation's records only.

// stepTable is the store's step records.
type stepTable struct {
	mu  sync.Mutex
	ops map[opID]map[string]*idem.StepRecord // by operation, then name
	n   int                                  // records held
}

type opID struct{ scope, key string }

type stepID struct{ scope, key, name string }

var _ idem.StepStore = (*Store)(nil)

// live returns the live record of id at now, or nil. The caller holds mu.
func (t *stepTable) live(id stepID, now time.Time) *idem.StepRecord {
	r := t.ops[opID{id.scope, id.key}][id.name]
	if r == nil || !r.ExpiresAt.After(now) {
		return nil
	}
	return r
}

// put stores r under its (scope, key, name). The caller holds mu.
func (t *stepTable) put(r *idem.StepRecord) {
	if t.ops == nil {
		t.ops = make(map[opID]map[string]*idem.StepRecord)
	}
	op := opID{r.Scope, r.Key}
	m := t.ops[op]
	if m == nil {
		m = make(map[string]*idem.StepRecord, 2)
		t.ops[op] = m
	}
	if _, ok := m[r.Name]; !ok {
		t.n++
	}
	m[r.Name] = r
}

// remove deletes the record of id. The caller holds mu.
func (t *stepTable) remove(id stepID) {
	op := opID{id.scope, id.key}
	m := t.ops[op]
	if _, ok := m[id.name]; !ok {
		return
	}
	delete(m, id.name)
	t.n--
	if len(m) == 0 {
		delete(t.ops, op)
	}
}

// otherOf returns a live record of (scope, key) whose fingerprint is set and
// differs from fp, or nil. The caller holds mu.
func (t *stepTable) otherOf(scope, key, fp string, now time.Time) *idem.StepRecord {
	for _, r := range t.ops[opID{scope, key}] {
		if r.ExpiresAt.After(now) && r.Fingerprint != "" && r.Fingerprint != fp {
			return r
		}
	}
	return nil
}

// copyStep returns a copy of r that shares no memory with the store.
func copyStep(r *idem.StepRecord) *idem.StepRecord {
	c := *r
	if r.Result != nil {
		c.Result = append([]byte(nil), r.Result...)
	}
	return &c
}

// BeginStep implements idem.StepStore.
func (s *Store) BeginStep(_ context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	s.seen(req.Now)
	if req.Holder {
		sh, h := s.shard(req.Scope, req.Key)
		sh.mu.Lock()
		defer sh.mu.Unlock()
		b := sh.get(h, req.Scope, req.Key)
		if b == nil || state(b) != idem.StateInFlight || tokenOf(b) != req.Owner || getNanos(b, offExpires) <= unixNanos(req.Now) {
			return nil, false, idem.ErrLockLost
		}
	}
	t := &s.steps
	t.mu.Lock()
	defer t.mu.Unlock()
	if req.First && req.Fingerprint != "" {
		if o := t.otherOf(req.Scope, req.Key, req.Fingerprint, req.Now); o != nil {
			return copyStep(o), false, nil // another request's key: nothing written
		}
	}
	id := stepID{req.Scope, req.Key, req.Name}
	r := t.live(id, req.Now)
	if r == nil {
		// The strings are copied: the middleware's alias the request's own
		// memory (its fingerprint, its lock token), which a record kept for
		// its TTL would otherwise keep alive, the buffered response with it.
		id = stepID{strings.Clone(req.Scope), strings.Clone(req.Key), strings.Clone(req.Name)}
		r = &idem.StepRecord{
			Scope: id.scope, Key: id.key, Name: id.name, State: idem.StepStarted,
			Owner: strings.Clone(req.Owner), DerivedKey: strings.Clone(req.DerivedKey), Fingerprint: strings.Clone(req.Fingerprint), StartedAt: req.Now, ExpiresAt: req.ExpiresAt,
		}
		t.put(r)
		return copyStep(r), true, nil
	}
	if r.Fingerprint != "" && req.Fingerprint != "" && r.Fingerprint != req.Fingerprint {
		return copyStep(r), false, nil // another request's: left as it is
	}
	if req.ExpiresAt.After(r.ExpiresAt) {
		r.ExpiresAt = req.ExpiresAt
	}
	began := r.State == idem.StepStarted && r.Owner != req.Owner && (r.Owner == "" || req.Rerun)
	if began {
		r.Owner = strings.Clone(req.Owner)
	}
	return copyStep(r), began, nil
}

// owned returns the live StepStarted record of id begun by owner, or nil. The
// caller holds mu.
func (t *stepTable) owned(id stepID, owner string, now time.Time) *idem.StepRecord {
	r := t.live(id, now)
	if r == nil || r.State != idem.StepStarted || owner == "" || r.Owner != owner {
		return nil
	}
	return r
}

// FinishStep implements idem.StepStore. The result is copied.
func (s *Store) FinishStep(_ context.Context, scope, key, name, owner string, st idem.StepState, result []byte, now time.Time) error {
	if st != idem.StepDone && st != idem.StepFailed {
		return fmt.Errorf("memstore: FinishStep with state %v; want done or failed", st)
	}
	s.seen(now)
	t := &s.steps
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.owned(stepID{scope, key, name}, owner, now)
	if r == nil {
		return idem.ErrLockLost
	}
	r.State, r.Result = st, append([]byte{}, result...)
	return nil
}

// AbandonStep implements idem.StepStore.
func (s *Store) AbandonStep(_ context.Context, scope, key, name, owner string, now time.Time) error {
	s.seen(now)
	t := &s.steps
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.owned(stepID{scope, key, name}, owner, now)
	if r == nil {
		return idem.ErrLockLost
	}
	r.Owner = ""
	return nil
}

// GetSteps implements idem.StepStore. The records are copies.
func (s *Store) GetSteps(_ context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	t := &s.steps
	t.mu.Lock()
	var out []idem.StepRecord
	for _, r := range t.ops[opID{scope, key}] {
		if r.ExpiresAt.After(now) {
			out = append(out, *copyStep(r))
		}
	}
	t.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if !out[i].StartedAt.Equal(out[j].StartedAt) {
			return out[i].StartedAt.Before(out[j].StartedAt)
		}
		return out[i].Name < out[j].Name
	})
	return out, nil
}

// errSettleState is SettleStep's answer to a state it does not write.
var errSettleState = errors.New("memstore: SettleStep writes done, failed or 0 (delete)")

// SettleStep implements idem.StepStore.
func (s *Store) SettleStep(_ context.Context, scope, key, name string, st idem.StepState, result []byte, now time.Time) error {
	if st != 0 && st != idem.StepDone && st != idem.StepFailed {
		return errSettleState
	}
	t := &s.steps
	t.mu.Lock()
	defer t.mu.Unlock()
	id := stepID{scope, key, name}
	r := t.live(id, now)
	if r == nil {
		return idem.ErrNotFound
	}
	if st == 0 {
		t.remove(id)
		return nil
	}
	r.State, r.Result, r.Owner = st, append([]byte{}, result...), ""
	return nil
}

// DeleteExpiredSteps implements idem.StepStore.
func (s *Store) DeleteExpiredSteps(ctx context.Context, now time.Time, limit int) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	t := &s.steps
	t.mu.Lock()
	defer t.mu.Unlock()
	deleted := 0
	for _, m := range t.ops {
		for _, r := range m {
			if deleted >= limit {
				return deleted, nil
			}
			if !r.ExpiresAt.After(now) {
				t.remove(stepID{r.Scope, r.Key, r.Name})
				deleted++
			}
		}
	}
	return deleted, nil
}

// StepLen returns the number of step records held, expired ones included.
func (s *Store) StepLen() int {
	s.steps.mu.Lock()
	defer s.steps.mu.Unlock()
	return s.steps.n
}
