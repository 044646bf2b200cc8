package sqlitestore

import (
	"context"
	"database/sql"
	"fmt"
	"runtime"
	"sync"
	"time"
	"weak"
)

// gate queues this process's idem writes on one *sql.DB for SQLite's single write
// lock. Waiting in a channel hands the lock over at once and in arrival order,
// where SQLite's busy handler would poll with growing sleeps, and a wait here
// never ends in SQLITE_BUSY. Writers in other processes, and the application's
// own writes outside idem, still meet the store's writes at SQLite's lock, under
// the driver's busy timeout.
type gate chan struct{}

// shared is what every Store on one *sql.DB shares: the gate, and the keys of
// the single-transaction requests in flight.
type shared struct {
	gate gate
	busy busyKeys
}

// dbs holds the shared state of each *sql.DB; an entry goes when its *sql.DB is
// garbage.
var dbs sync.Map // weak.Pointer[sql.DB] -> *shared

func sharedFor(db *sql.DB) *shared {
	k := weak.Make(db)
	if sh, ok := dbs.Load(k); ok {
		return sh.(*shared)
	}
	sh, loaded := dbs.LoadOrStore(k, &shared{gate: make(gate, 1)})
	if !loaded {
		runtime.AddCleanup(db, func(k weak.Pointer[sql.DB]) { dbs.Delete(k) }, k)
	}
	return sh.(*shared)
}

// errLockTimeout says what a timed-out wait for the gate means.
type errLockTimeout struct{ d time.Duration }

func (e errLockTimeout) Error() string {
	return fmt.Sprintf("waited %v for SQLite's write lock, held by another idem transaction of this process; handlers hold it for their whole transaction, so keep them short, or raise Config.LockTimeout", e.d)
}

// lock waits for the gate until ctx ends or timeout passes, and returns the
// function that opens it again.
func (g gate) lock(ctx context.Context, timeout time.Duration) (unlock func(), err error) {
	if err := g.acquire(ctx, timeout); err != nil {
		return nil, err
	}
	return g.unlock, nil
}

// acquire waits for the gate until ctx ends or timeout passes; unlock opens it
// again.
func (g gate) acquire(ctx context.Context, timeout time.Duration) error {
	select {
	case g <- struct{}{}:
		return nil
	default:
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case g <- struct{}{}:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-t.C:
		return errLockTimeout{timeout}
	}
}

func (g gate) unlock() { <-g }

// LockWrites queues a write on db behind the writes this process's Stores on
// db make (every request's transaction among them), for code that writes to
// the same file outside a Store, such as sqliteoutbox's relay statements:
// it waits until the gate is free, ctx ends or timeout passes, and returns
// the function that frees it again. Run one statement or one short
// transaction under it, never a request's work.
func LockWrites(ctx context.Context, db *sql.DB, timeout time.Duration) (unlock func(), err error) {
	return sharedFor(db).gate.lock(ctx, timeout)
}
