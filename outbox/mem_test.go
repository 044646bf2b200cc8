package outbox_test

import (
	"context"
	"sync"
	"time"

	"github.com/idemkit/idem/outbox"
)

// memSource is an in-memory outbox.Source for the unit tests: the rules of
// the real tables (heads of partitions, leases, fencing) on a slice.
type memSource struct {
	mu   sync.Mutex
	seq  int64
	rows []*memRow
	dead []outbox.Stored
}

type memRow struct {
	outbox.Stored
	owner     string
	until     time.Time
	next      time.Time
	published time.Time
}

func (s *memSource) add(ms ...outbox.Message) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, m := range ms {
		s.seq++
		s.rows = append(s.rows, &memRow{Stored: outbox.Stored{Message: m, Seq: s.seq, EnqueuedAt: time.Now()}})
	}
}

func (s *memSource) Lease(_ context.Context, owner string, n int, d time.Duration) ([]outbox.Stored, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	blocked := map[string]bool{}
	var out []outbox.Stored
	for _, r := range s.rows {
		if !r.published.IsZero() {
			continue
		}
		head := !blocked[r.PartitionKey]
		blocked[r.PartitionKey] = true
		if !head || now.Before(r.next) || now.Before(r.until) || len(out) == n {
			continue
		}
		r.owner, r.until = owner, now.Add(d)
		out = append(out, r.Stored)
		r.Attempts++
	}
	return out, nil
}

func (s *memSource) find(owner string, seq int64) *memRow {
	for _, r := range s.rows {
		if r.Seq == seq && r.owner == owner && r.published.IsZero() {
			return r
		}
	}
	return nil
}

func (s *memSource) MarkPublished(_ context.Context, owner string, seqs ...int64) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, q := range seqs {
		if r := s.find(owner, q); r != nil {
			r.published, r.owner, r.until = time.Now(), "", time.Time{}
			n++
		}
	}
	return n, nil
}

func (s *memSource) Retry(_ context.Context, owner string, seq int64, in time.Duration, _ string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r := s.find(owner, seq); r != nil {
		r.owner, r.until, r.next = "", time.Time{}, time.Now().Add(in)
	}
	return nil
}

func (s *memSource) DeadLetter(_ context.Context, owner string, seq int64, _ string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, r := range s.rows {
		if r.Seq == seq && r.owner == owner && r.published.IsZero() {
			s.dead = append(s.dead, r.Stored)
			s.rows = append(s.rows[:i], s.rows[i+1:]...)
			break
		}
	}
	return nil
}

func (s *memSource) DeletePublished(_ context.Context, older time.Duration, limit int) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	keep := s.rows[:0]
	for _, r := range s.rows {
		if n < limit && !r.published.IsZero() && time.Since(r.published) > older {
			n++
			continue
		}
		keep = append(keep, r)
	}
	s.rows = keep
	return n, nil
}

func (s *memSource) Stats(context.Context) (outbox.Stats, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var st outbox.Stats
	for _, r := range s.rows {
		if r.published.IsZero() {
			st.Pending++
			st.OldestPending = max(st.OldestPending, time.Since(r.EnqueuedAt))
		}
	}
	st.DeadLetters = int64(len(s.dead))
	return st, nil
}
