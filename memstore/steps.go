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
// the write; the lock order is always shard, then steps.

// stepTable is the store's step records.
type stepTable struct {
	mu   sync.Mutex
	recs map[stepID]*idem.StepRecord
}

type stepID struct{ scope, key, name string }

var _ idem.StepStore = (*Store)(nil)

// live returns the live record of id at now, or nil. The caller holds mu.
func (t *stepTable) live(id stepID, now time.Time) *idem.StepRecord {
	r := t.recs[id]
	if r == nil || !r.ExpiresAt.After(now) {
		return nil
	}
	return r
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
	if t.recs == nil {
		t.recs = make(map[stepID]*idem.StepRecord)
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
		t.recs[id] = r
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
	for id, r := range t.recs {
		if id.scope == scope && id.key == key && r.ExpiresAt.After(now) {
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
		delete(t.recs, id)
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
	for id, r := range t.recs {
		if deleted >= limit {
			break
		}
		if !r.ExpiresAt.After(now) {
			delete(t.recs, id)
			deleted++
		}
	}
	return deleted, nil
}

// StepLen returns the number of step records held, expired ones included.
func (s *Store) StepLen() int {
	s.steps.mu.Lock()
	defer s.steps.mu.Unlock()
	return len(s.steps.recs)
}
