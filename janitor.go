package idem

import (
	"context"
	"fmt"
	"time"
)

// Janitor deletes expired records in bounded batches, so that no single statement
// holds locks for long. Run it in the background (Run) or once (Sweep, as
// `idem gc` does).
type Janitor struct {
	// Store is the store to clean.
	Store Store
	// Interval is the pause between sweeps in Run. Defaults to one minute.
	Interval time.Duration
	// BatchSize is the most records one DeleteExpired call deletes. Defaults to 1000.
	BatchSize int
	// NowFunc is the clock. Defaults to time.Now.
	NowFunc func() time.Time
	// OnSweep, when set, is called after each sweep in Run with what it did.
	OnSweep func(deleted int, err error)
}

// Sweep deletes every record expired at the time of the call, batch by batch, and
// returns how many it deleted; when the store is a StepStore, its expired step
// records go next, counted with them. It stops early, returning what it deleted so far,
// when ctx ends or the store fails.
func (j *Janitor) Sweep(ctx context.Context) (int, error) {
	if j.Store == nil {
		return 0, fmt.Errorf("idem: Janitor.Store is nil; set it to the store to clean")
	}
	batch := j.BatchSize
	if batch <= 0 {
		batch = 1000
	}
	now := time.Now
	if j.NowFunc != nil {
		now = j.NowFunc
	}
	cutoff := now()
	total := 0
	for {
		n, err := j.Store.DeleteExpired(ctx, cutoff, batch)
		total += n
		if err != nil {
			return total, fmt.Errorf("idem: janitor deleted %d records, then: %w", total, err)
		}
		if n < batch {
			break
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
	ss, ok := j.Store.(StepStore)
	if !ok {
		return total, nil
	}
	for {
		n, err := ss.DeleteExpiredSteps(ctx, cutoff, batch)
		total += n
		if err != nil {
			return total, fmt.Errorf("idem: janitor deleted %d records and step records, then: %w", total, err)
		}
		if n < batch {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}

// Run sweeps every Interval until ctx ends. It returns ctx's error.
func (j *Janitor) Run(ctx context.Context) error {
	interval := j.Interval
	if interval <= 0 {
		interval = time.Minute
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
			n, err := j.Sweep(ctx)
			if j.OnSweep != nil {
				j.OnSweep(n, err)
			}
		}
	}
}
