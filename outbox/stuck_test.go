package outbox_test

import (
	"context"
	"errors"
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
