package pgstore

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/wakehub"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

var _ idem.OutcomeNotifier = (*Store)(nil)

// listenLinger is how long the listener connection stays open after the last
// watch ended, so that a burst of waits does not connect once per key.
const listenLinger = 30 * time.Second

// listenWait bounds how long WatchOutcome waits for the listener to be in
// place before it gives up (the middleware then polls).
const listenWait = 5 * time.Second

// listener is the one LISTEN connection of a Store: opened, outside the pool,
// on the first watch, and closed listenLinger after the last one ended.
type listener struct {
	pool    *pgxpool.Pool
	channel string
	hub     wakehub.Hub

	mu       sync.Mutex
	watchers int
	cancel   context.CancelFunc // the running listener, or nil
	ready    chan struct{}      // closed once LISTEN is in place; replaced when the connection drops
	linger   *time.Timer
}

// channelName is the notification channel of table: the same in every
// process that uses the table, different for another table.
func channelName(table string) string {
	sum := sha256.Sum256([]byte(table))
	return "idem_outcome_" + hex.EncodeToString(sum[:8])
}

func newListener(pool *pgxpool.Pool, table string) *listener {
	return &listener{pool: pool, channel: channelName(table)}
}

// WatchOutcome watches (scope, key) for NotifyOutcome from any process using
// the table, through one LISTEN connection per Store, opened outside the pool
// on the first watch (a waiting request holds no pool connection). It
// implements idem.OutcomeNotifier.
func (s *Store) WatchOutcome(ctx context.Context, scope, key string) (<-chan struct{}, func(), error) {
	l := s.listen
	l.mu.Lock()
	l.watchers++
	if l.linger != nil {
		l.linger.Stop()
		l.linger = nil
	}
	if l.cancel == nil {
		lctx, cancel := context.WithCancel(context.Background())
		l.cancel = cancel
		l.ready = make(chan struct{})
		go l.run(lctx)
	}
	ready := l.ready
	l.mu.Unlock()
	ch, stop := l.hub.Watch(wakehub.ID(scope, key))
	done := func() {
		stop()
		l.release()
	}
	t := time.NewTimer(listenWait)
	defer t.Stop()
	select {
	case <-ready:
		return ch, done, nil
	case <-ctx.Done():
		done()
		return nil, nil, ctx.Err()
	case <-t.C:
		done()
		return nil, nil, fmt.Errorf("pgstore: the LISTEN connection for %s is not up after %v (is the database reachable?); waiting requests poll instead", l.channel, listenWait)
	}
}

// NotifyOutcome sends a notification of (scope, key) on the table's channel
// (pg_notify, one statement on the pool). It implements
// idem.OutcomeNotifier.
func (s *Store) NotifyOutcome(ctx context.Context, scope, key string) error {
	if _, err := s.pool.Exec(ctx, "SELECT pg_notify($1, $2)", s.listen.channel, wakehub.ID(scope, key)); err != nil {
		return fmt.Errorf("pgstore: notify: %w", err)
	}
	return nil
}

// release ends one watch; the last one closes the connection after
// listenLinger.
func (l *listener) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.watchers--
	if l.watchers > 0 || l.cancel == nil {
		return
	}
	cancel := l.cancel
	l.linger = time.AfterFunc(listenLinger, func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.watchers == 0 && l.cancel != nil {
			cancel()
			l.cancel, l.linger = nil, nil
		}
	})
}

// run keeps the LISTEN connection up until ctx ends, handing notifications
// to the hub. When the connection drops, every watcher is woken (it may have
// missed one) and it connects again.
func (l *listener) run(ctx context.Context) {
	const firstBackoff = 50 * time.Millisecond
	backoff := firstBackoff
	for ctx.Err() == nil {
		up, err := l.listenOnce(ctx)
		if err == nil || ctx.Err() != nil {
			return
		}
		if up {
			// It was listening: a new drop, not one more failure to connect.
			backoff = firstBackoff
		}
		l.mu.Lock()
		select {
		case <-l.ready:
			l.ready = make(chan struct{}) // it was up: new watchers wait for the next connection
		default:
		}
		l.mu.Unlock()
		l.hub.NotifyAll()
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, 5*time.Second)
	}
}

// listenOnce connects, listens, and delivers notifications until the
// connection fails or ctx ends. up tells that LISTEN was in place.
func (l *listener) listenOnce(ctx context.Context) (up bool, _ error) {
	conn, err := pgx.ConnectConfig(ctx, l.pool.Config().ConnConfig.Copy())
	if err != nil {
		return false, err
	}
	defer func() {
		cctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(cctx)
	}()
	// The connection idles between notifications by design: a session default
	// of idle_session_timeout (a role's or the pool's RuntimeParams) would end
	// it again and again, each time waking every waiter and missing what is
	// notified until it is back. PostgreSQL before 14 has no such setting
	// (undefined_object, ignored).
	if _, err := conn.Exec(ctx, "SET idle_session_timeout = 0"); err != nil {
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "42704" {
			return false, err
		}
	}
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{l.channel}.Sanitize()); err != nil {
		return false, err
	}
	l.mu.Lock()
	select {
	case <-l.ready:
	default:
		close(l.ready)
	}
	l.mu.Unlock()
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			if errors.Is(err, context.Canceled) {
				return true, nil
			}
			return true, err
		}
		l.hub.Notify(n.Payload)
	}
}
