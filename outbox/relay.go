package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	mrand "math/rand/v2"
	"os"
	"sync"
	"time"
)

// Defaults of the Relay's settings.
const (
	DefaultBatchSize         = 100
	DefaultConcurrency       = 16
	DefaultPollInterval      = 200 * time.Millisecond
	DefaultLeaseDuration     = 30 * time.Second
	DefaultPublishTimeout    = 10 * time.Second
	DefaultMinBackoff        = 100 * time.Millisecond
	DefaultMaxBackoff        = 30 * time.Second
	DefaultRetention         = 7 * 24 * time.Hour
	DefaultRetentionInterval = time.Minute
	DefaultRetentionBatch    = 1000
	DefaultStatsInterval     = 10 * time.Second
)

// Relay publishes the committed messages of a Source through a Publisher. Set
// Source and Publisher; every other field has a default. Several relays (in
// one process or many) may run on one Source: they share the work, never
// lease one message twice while a lease holds, and keep the order of each
// partition. Do not change the fields while Run runs.
type Relay struct {
	// Source is the outbox table (required).
	Source Source
	// Publisher is the broker (required).
	Publisher Publisher
	// Observer sees what the relay does (metrics); nil observes nothing.
	Observer Observer
	// Owner names this relay in the leases it takes: unique per relay.
	// Defaults to the host name, the process ID and a random suffix.
	Owner string
	// BatchSize is the most messages leased at once (DefaultBatchSize).
	BatchSize int
	// Concurrency is the most publications in flight at once
	// (DefaultConcurrency); they are of different partitions.
	Concurrency int
	// PollInterval is the wait after a batch that found nothing
	// (DefaultPollInterval). Wake cuts it short.
	PollInterval time.Duration
	// Wake, when a message arrives on it, makes an idle relay look at once
	// (for example from a LISTEN/NOTIFY or from the process that enqueues).
	Wake <-chan struct{}
	// LeaseDuration is how long a leased message is this relay's
	// (DefaultLeaseDuration). If the relay dies, another publishes the
	// message after it lapses: it bounds the delay a crash adds.
	LeaseDuration time.Duration
	// PublishTimeout bounds one publication (DefaultPublishTimeout, and at
	// most half the LeaseDuration): a publication still unconfirmed then is
	// a failure, retried.
	PublishTimeout time.Duration
	// MinBackoff and MaxBackoff bound the wait before a failed message is
	// tried again: MinBackoff doubled per attempt, with jitter, at most
	// MaxBackoff (DefaultMinBackoff, DefaultMaxBackoff). MaxBackoff is also
	// the most a broker's recovery waits for the relay to notice it.
	MinBackoff, MaxBackoff time.Duration
	// Retention is how long published messages are kept before they are
	// deleted (DefaultRetention); negative keeps them forever.
	Retention time.Duration
	// RetentionInterval is how often the relay deletes
	// (DefaultRetentionInterval), RetentionBatch the most one statement
	// deletes (DefaultRetentionBatch).
	RetentionInterval time.Duration
	RetentionBatch    int
	// StatsInterval is how often the relay reads Source.Stats for the
	// Observer (DefaultStatsInterval); negative never.
	StatsInterval time.Duration

	once sync.Once
	cfg  *Relay // the resolved copy
}

func (r *Relay) resolve() error {
	if r.Source == nil || r.Publisher == nil {
		return errors.New("outbox: Relay needs a Source (a store's outbox, e.g. pgoutbox.New) and a Publisher (e.g. natsjs.NewPublisher)")
	}
	r.once.Do(func() {
		c := &Relay{
			Source: r.Source, Publisher: r.Publisher, Observer: r.Observer, Owner: r.Owner,
			BatchSize: r.BatchSize, Concurrency: r.Concurrency, PollInterval: r.PollInterval, Wake: r.Wake,
			LeaseDuration: r.LeaseDuration, PublishTimeout: r.PublishTimeout,
			MinBackoff: r.MinBackoff, MaxBackoff: r.MaxBackoff, Retention: r.Retention,
			RetentionInterval: r.RetentionInterval, RetentionBatch: r.RetentionBatch, StatsInterval: r.StatsInterval,
		}
		if c.Observer == nil {
			c.Observer = NopObserver{}
		}
		if c.Owner == "" {
			c.Owner = NewOwner()
		}
		def := func(d *time.Duration, v time.Duration) {
			if *d <= 0 {
				*d = v
			}
		}
		if c.BatchSize <= 0 {
			c.BatchSize = DefaultBatchSize
		}
		if c.Concurrency <= 0 {
			c.Concurrency = DefaultConcurrency
		}
		if c.RetentionBatch <= 0 {
			c.RetentionBatch = DefaultRetentionBatch
		}
		def(&c.PollInterval, DefaultPollInterval)
		def(&c.LeaseDuration, DefaultLeaseDuration)
		def(&c.PublishTimeout, DefaultPublishTimeout)
		if c.PublishTimeout > c.LeaseDuration/2 {
			c.PublishTimeout = c.LeaseDuration / 2
		}
		def(&c.MinBackoff, DefaultMinBackoff)
		def(&c.MaxBackoff, DefaultMaxBackoff)
		if c.MaxBackoff < c.MinBackoff {
			c.MaxBackoff = c.MinBackoff
		}
		if c.Retention == 0 {
			c.Retention = DefaultRetention
		}
		def(&c.RetentionInterval, DefaultRetentionInterval)
		if c.StatsInterval == 0 {
			c.StatsInterval = DefaultStatsInterval
		}
		r.cfg = c
	})
	return nil
}

// NewOwner returns a relay owner name: host name, process ID, random suffix.
func NewOwner() string {
	host, _ := os.Hostname()
	if len(host) > 32 {
		host = host[:32]
	}
	var b [6]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%d-%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// Run publishes until ctx ends, then returns nil; it returns an error only
// when the Relay is misconfigured. It survives a failing database and a
// failing broker (it waits with backoff and tries again) and runs the
// retention and the stats in the background.
func (r *Relay) Run(ctx context.Context) error {
	if err := r.resolve(); err != nil {
		return err
	}
	c := r.cfg
	var wg sync.WaitGroup
	defer wg.Wait()
	if c.Retention > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); r.retain(ctx) }()
	}
	if c.StatsInterval > 0 {
		wg.Add(1)
		go func() { defer wg.Done(); r.stats(ctx) }()
	}
	failures := 0
	for ctx.Err() == nil {
		n, err := r.PublishBatch(ctx)
		var wait time.Duration
		switch {
		case err != nil && ctx.Err() == nil:
			failures++
			wait = r.backoff(failures)
		case n == 0:
			failures = 0
			wait = c.PollInterval
		default:
			failures = 0
			continue
		}
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
		case <-t.C:
		case <-c.Wake:
		}
		t.Stop()
	}
	return nil
}

// PublishBatch leases one batch, publishes it and records the outcomes; it
// returns how many messages it leased. Run calls it in a loop; a test or a
// command that drains the outbox once may call it directly. An error is the
// Source's (the database's): the messages of the batch that were published
// but not marked are published again after their lease lapses.
func (r *Relay) PublishBatch(ctx context.Context) (int, error) {
	if err := r.resolve(); err != nil {
		return 0, err
	}
	c := r.cfg
	start := time.Now()
	leaseEnd := start.Add(c.LeaseDuration)
	batch, err := c.Source.Lease(ctx, c.Owner, c.BatchSize, c.LeaseDuration)
	if err != nil {
		c.Observer.SourceFailed(err)
		return 0, err
	}
	if len(batch) == 0 {
		return 0, nil
	}
	// The batch by partition, each in seq order: a Source may lease, after
	// the head of a partition, the messages that follow it (a run). A run is
	// published in order, one message after the other, each marked (or
	// dead-lettered) before the next goes, and stops at the first failure that is not permanent;
	// runs of different partitions are published at once, Concurrency at a
	// time, and the last (or only) message of each is marked with the rest
	// of the batch.
	var runs [][]int
	pos := map[string]int{}
	for i := range batch {
		k, ok := pos[batch[i].PartitionKey]
		if !ok {
			k = len(runs)
			pos[batch[i].PartitionKey] = k
			runs = append(runs, nil)
		}
		runs[k] = append(runs[k], i)
	}
	errs := make([]error, len(batch))
	marked := make([]bool, len(batch))
	dead := make([]bool, len(batch)) // dead-lettered (or tried to) within its run
	markErrs := make([]error, len(batch))
	sem := make(chan struct{}, c.Concurrency)
	var wg sync.WaitGroup
	for _, run := range runs {
		sem <- struct{}{}
		wg.Add(1)
		go func(run []int) {
			defer func() { <-sem; wg.Done() }()
			for j, i := range run {
				// The lease must outlast the publication by a margin, so
				// that no other relay publishes the message while this
				// one does.
				if time.Until(leaseEnd) < c.PublishTimeout+c.PublishTimeout/2 {
					errs[i] = errLeaseShort
					for _, k := range run[j+1:] {
						errs[k] = errNotTried
					}
					return
				}
				pctx, cancel := context.WithTimeout(ctx, c.PublishTimeout)
				errs[i] = safePublish(pctx, c.Publisher, &batch[i])
				cancel()
				if errs[i] != nil && !IsPermanent(errs[i]) {
					for _, k := range run[j+1:] {
						errs[k] = errNotTried
					}
					return
				}
				if errs[i] != nil && j < len(run)-1 {
					// Dead-lettered before the next one goes, as a
					// published one is marked: if it stayed in the outbox
					// (a failed statement, a crash), it would be published
					// again after the messages that follow it.
					dctx, dcancel := context.WithTimeout(context.WithoutCancel(ctx), c.PublishTimeout)
					err := c.Source.DeadLetter(dctx, c.Owner, batch[i].Seq, errs[i].Error())
					dcancel()
					dead[i] = true
					if err != nil {
						c.Observer.SourceFailed(err)
						markErrs[i] = err
						for _, k := range run[j+1:] {
							errs[k] = errNotTried
						}
						return
					}
					c.Observer.DeadLettered(&batch[i], errs[i].Error())
					continue
				}
				if errs[i] == nil && j < len(run)-1 {
					// Marked before the next one goes: a crash then
					// republishes this one message at most, so each
					// partition's confirmations stay in seq order.
					// Even after ctx ended (the broker confirmed it), but
					// within PublishTimeout, like the batch's other marks.
					mctx, mcancel := context.WithTimeout(context.WithoutCancel(ctx), c.PublishTimeout)
					n, err := c.Source.MarkPublished(mctx, c.Owner, batch[i].Seq)
					mcancel()
					if err != nil || n != 1 {
						if err != nil {
							c.Observer.SourceFailed(err)
							markErrs[i] = err
						}
						for _, k := range run[j+1:] {
							errs[k] = errNotTried
						}
						return
					}
					marked[i] = true
				}
			}
		}(run)
	}
	wg.Wait()
	// The outcomes are recorded even after ctx ended (a publication the
	// broker confirmed should be marked), but within PublishTimeout: a
	// database that stopped answering must not hold the relay, or its
	// shutdown, for ever (what is not marked is published again later).
	fctx, fcancel := context.WithTimeout(context.WithoutCancel(ctx), c.PublishTimeout)
	defer fcancel()
	var done []int64
	var srcErr error
	now := time.Now()
	for i := range batch {
		m := &batch[i]
		if markErrs[i] != nil {
			srcErr = errors.Join(srcErr, markErrs[i])
		}
		switch err := errs[i]; {
		case err == nil:
			if !marked[i] {
				done = append(done, m.Seq)
			}
			c.Observer.Published(m, now.Sub(m.EnqueuedAt))
		case dead[i]:
			// Dead-lettered within its run; if that failed, it is
			// the partition's head again once its lease lapses.
		case IsPermanent(err):
			reason := err.Error()
			if e := c.Source.DeadLetter(fctx, c.Owner, m.Seq, reason); e != nil {
				c.Observer.SourceFailed(e)
				srcErr = errors.Join(srcErr, e)
				continue
			}
			c.Observer.DeadLettered(m, reason)
		case errors.Is(err, errNotTried):
			// Behind a failure in its partition: released as it was.
			if e := c.Source.Retry(fctx, c.Owner, m.Seq, 0, err.Error()); e != nil {
				c.Observer.SourceFailed(e)
				srcErr = errors.Join(srcErr, e)
			}
		default:
			in := r.backoff(m.Attempts + 1)
			if errors.Is(err, errLeaseShort) {
				in = 0
			}
			if e := c.Source.Retry(fctx, c.Owner, m.Seq, in, err.Error()); e != nil {
				c.Observer.SourceFailed(e)
				srcErr = errors.Join(srcErr, e)
				continue
			}
			c.Observer.Failed(m, err, in)
		}
	}
	if len(done) > 0 {
		if _, err := c.Source.MarkPublished(fctx, c.Owner, done...); err != nil {
			c.Observer.SourceFailed(err)
			srcErr = errors.Join(srcErr, err)
		}
	}
	c.Observer.Batch(len(batch), time.Since(start))
	return len(batch), srcErr
}

var (
	errLeaseShort = errors.New("outbox: the lease would lapse before the publication could end; released")
	errNotTried   = errors.New("outbox: not tried: an earlier message of its partition failed; released")
)

// safePublish turns a panicking Publisher into an error.
func safePublish(ctx context.Context, p Publisher, m *Stored) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = fmt.Errorf("outbox: Publisher panicked: %v", v)
		}
	}()
	return p.Publish(ctx, m)
}

// backoff is the wait before attempt n+1: MinBackoff·2^(n-1), jittered by
// ±25%, at most MaxBackoff.
func (r *Relay) backoff(n int) time.Duration {
	c := r.cfg
	d := c.MinBackoff
	for i := 1; i < n && d < c.MaxBackoff; i++ {
		d *= 2
	}
	if d > c.MaxBackoff {
		d = c.MaxBackoff
	}
	j := time.Duration(mrand.Int64N(int64(d)/2+1)) - d/4
	d += j
	if d > c.MaxBackoff {
		d = c.MaxBackoff
	}
	return d
}

// retain deletes published messages older than the retention, in batches.
func (r *Relay) retain(ctx context.Context) {
	c := r.cfg
	t := time.NewTicker(c.RetentionInterval)
	defer t.Stop()
	for {
		for ctx.Err() == nil {
			n, err := c.Source.DeletePublished(ctx, c.Retention, c.RetentionBatch)
			if err != nil {
				if ctx.Err() == nil {
					c.Observer.SourceFailed(err)
				}
				break
			}
			if n > 0 {
				c.Observer.Deleted(n)
			}
			if n < c.RetentionBatch {
				break
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// stats reads the Source's counts for the Observer.
func (r *Relay) stats(ctx context.Context) {
	c := r.cfg
	t := time.NewTicker(c.StatsInterval)
	defer t.Stop()
	for {
		s, err := c.Source.Stats(ctx)
		if err == nil {
			c.Observer.Stats(s)
		} else if ctx.Err() == nil {
			c.Observer.SourceFailed(err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
