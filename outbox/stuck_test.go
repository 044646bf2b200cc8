package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
)

// stuckSource leases one run of three messages of one partition, once, and
// then stops answering: its MarkPublished and Retry wait for their context
// to end (a database behind a cut connection, which no TCP reset reaches).
type stuckSource struct{ memSource }

func (s *stuckSource) Lease(ctx context.Context, owner string, n int, d time.Duration) ([]outbox.Stored, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.seq > 0 {
		return nil, nil
	}
	var out []outbox.Stored
	for i, id := range []string{"first", "second", "third"} {
		s.seq++
		out = append(out, outbox.Stored{Message: outbox.Message{ID: id, Subject: "s", PartitionKey: "P"}, Seq: int64(i + 1), EnqueuedAt: time.Now()})
	}
	return out, nil
}

func (s *stuckSource) MarkPublished(ctx context.Context, _ string, _ ...int64) (int, error) {
	<-ctx.Done()
	return 0, ctx.Err()
}

func (s *stuckSource) Retry(ctx context.Context, _ string, _ int64, _ time.Duration, _ string) error {
	<-ctx.Done()
	return ctx.Err()
}

// TestRelayStuckDatabaseMidRun: recording the outcomes of a run waits at
// most PublishTimeout per statement, on a database that stopped answering,
// both the mark of a run's message before the next goes and the release of
// the messages behind a failure. Before, both waited without a deadline, and
// PublishBatch (and the relay's shutdown) never returned.
func TestRelayStuckDatabaseMidRun(t *testing.T) {
	t.Parallel()
	for _, fail := range []bool{false, true} {
		pub := outbox.PublisherFunc(func(_ context.Context, m *outbox.Stored) error {
			if fail && m.ID == "first" {
				return errors.New("broker unavailable")
			}
			return nil
		})
		r := &outbox.Relay{Source: &stuckSource{}, Publisher: pub, LeaseDuration: 10 * time.Second, PublishTimeout: 200 * time.Millisecond, StatsInterval: -1, Retention: -1}
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan error, 1)
		go func() { _, err := r.PublishBatch(ctx); done <- err }()
		time.Sleep(50 * time.Millisecond)
		cancel() // the relay is shutting down
		select {
		case err := <-done:
			if err == nil {
				t.Fatalf("fail=%v: PublishBatch reported no error from a database that never answered", fail)
			}
		case <-time.After(20 * time.Second):
			t.Fatalf("fail=%v: PublishBatch still waiting for the database 20 s after its shutdown began (PublishTimeout 200ms)", fail)
		}
	}
}

// deadFailSource leases one run of three messages of one partition, once;
// it marks and releases them, but its DeadLetter fails (the database
// refused the statement, or the relay died before it).
type deadFailSource struct {
	stuckSource
	mu     sync.Mutex
	marked []string
	dead   int
}

func (s *deadFailSource) MarkPublished(_ context.Context, _ string, seqs ...int64) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, q := range seqs {
		s.marked = append(s.marked, fmt.Sprint(q))
	}
	return len(seqs), nil
}

func (s *deadFailSource) Retry(context.Context, string, int64, time.Duration, string) error {
	return nil
}

func (s *deadFailSource) DeadLetter(context.Context, string, int64, string) error {
	s.mu.Lock()
	s.dead++
	s.mu.Unlock()
	return errors.New("database refused the dead letter")
}

// TestRelayRunWaitsForItsDeadLetter: when a run's first message fails for
// good, the messages behind it are published only once it is dead-lettered;
// if that fails, they are not published (the first is still the partition's
// head, published or dead-lettered again after its lease lapses, and only
// then the rest). Before, the rest of the run was published and marked
// first and the first dead-lettered at the end of the batch: a dead letter
// that failed (or a relay that died before it) left the first in the
// outbox, to be published after the messages that follow it.
func TestRelayRunWaitsForItsDeadLetter(t *testing.T) {
	t.Parallel()
	src := &deadFailSource{}
	var mu sync.Mutex
	var published []string
	pub := outbox.PublisherFunc(func(_ context.Context, m *outbox.Stored) error {
		if m.ID == "first" {
			return outbox.Permanent(errors.New("no stream captures the subject"))
		}
		mu.Lock()
		published = append(published, m.ID)
		mu.Unlock()
		return nil
	})
	r := &outbox.Relay{Source: src, Publisher: pub, StatsInterval: -1, Retention: -1}
	if _, err := r.PublishBatch(context.Background()); err == nil {
		t.Fatal("PublishBatch reported no error although the dead letter failed")
	}
	mu.Lock()
	defer mu.Unlock()
	src.mu.Lock()
	defer src.mu.Unlock()
	if len(published) != 0 || len(src.marked) != 0 || src.dead != 1 {
		t.Fatalf("published %v, marked %v behind a message whose dead letter failed (%d dead-letter attempts): they would go before it", published, src.marked, src.dead)
	}
}
