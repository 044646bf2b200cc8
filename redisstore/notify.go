package redisstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/wakehub"
	"github.com/redis/go-redis/v9"
)

var _ idem.OutcomeNotifier = (*Store)(nil)

// subscribeLinger is how long the subscription stays after the last watch
// ended, so that a burst of waits does not subscribe once per key.
const subscribeLinger = 30 * time.Second

// subscriber is the one pub/sub connection of a Store, on the channel
// Prefix+"outcomes": opened on the first watch, closed subscribeLinger after
// the last one ended.
type subscriber struct {
	hub      wakehub.Hub
	mu       sync.Mutex
	watchers int
	ps       *redis.PubSub
	linger   *time.Timer
}

func (s *Store) outcomeChannel() string { return s.prefix + "outcomes" }

// WatchOutcome watches (scope, key) for NotifyOutcome from any process using
// the prefix, through one pub/sub connection per Store (a waiting request
// holds no pool connection). It implements idem.OutcomeNotifier.
func (s *Store) WatchOutcome(ctx context.Context, scope, key string) (<-chan struct{}, func(), error) {
	sub := &s.sub
	sub.mu.Lock()
	defer sub.mu.Unlock()
	if sub.linger != nil {
		sub.linger.Stop()
		sub.linger = nil
	}
	if sub.ps == nil {
		ps := s.client.Subscribe(ctx, s.outcomeChannel())
		if _, err := ps.Receive(ctx); err != nil { // the subscription is confirmed
			_ = ps.Close()
			return nil, nil, fmt.Errorf("redisstore: subscribe to %s: %w; waiting requests poll instead", s.outcomeChannel(), err)
		}
		sub.ps = ps
		msgs := ps.Channel()
		go func() {
			for m := range msgs {
				sub.hub.Notify(m.Payload)
			}
		}()
	}
	sub.watchers++
	ch, stop := sub.hub.Watch(wakehub.ID(scope, key))
	return ch, func() { stop(); sub.release() }, nil
}

// NotifyOutcome publishes (scope, key) on the store's channel. It implements
// idem.OutcomeNotifier.
func (s *Store) NotifyOutcome(ctx context.Context, scope, key string) error {
	if err := s.client.Publish(ctx, s.outcomeChannel(), wakehub.ID(scope, key)).Err(); err != nil {
		return fmt.Errorf("redisstore: publish: %w", err)
	}
	return nil
}

// release ends one watch; the last one closes the subscription after
// subscribeLinger.
func (sub *subscriber) release() {
	sub.mu.Lock()
	defer sub.mu.Unlock()
	sub.watchers--
	if sub.watchers > 0 || sub.ps == nil {
		return
	}
	sub.linger = time.AfterFunc(subscribeLinger, func() {
		sub.mu.Lock()
		defer sub.mu.Unlock()
		if sub.watchers == 0 && sub.ps != nil {
			_ = sub.ps.Close()
			sub.ps, sub.linger = nil, nil
		}
	})
}
