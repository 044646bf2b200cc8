// Package prooftest is the business side of the consumer adapters' proofs: a
// store (PostgreSQL or SQLite) with its own tables, an orders table without a
// unique constraint (so that a consumer without dedupe shows its duplicates),
// the handler that inserts one row per message through the store's
// transaction, and counts. A Target is plain data, so that a child process
// (the test binary re-executed) opens the same tables.
package prooftest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// Target names a store and an orders table.
type Target struct {
	Kind   string // "postgres" or "sqlite"
	URL    string // PostgreSQL URL or SQLite file
	Table  string // idem records
	Orders string // business rows
}

// Kinds are the stores every proof runs with.
var Kinds = []string{"postgres", "sqlite"}

// Rand returns a random lowercase hex suffix for names.
func Rand() string {
	var b [5]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// NewTarget returns a fresh Target of kind, skipping or failing as testenv
// says when PostgreSQL is unreachable.
func NewTarget(t testing.TB, kind string) Target {
	s := Rand()
	tg := Target{Kind: kind, Table: "cons_rec_" + s, Orders: "cons_orders_" + s}
	if kind == "postgres" {
		tg.URL = testenv.PostgresURL(t)
	} else {
		tg.URL = filepath.Join(t.TempDir(), "proof.db")
	}
	return tg
}

// Encode returns tg as JSON, for a child's environment.
func (tg Target) Encode() string {
	b, _ := json.Marshal(tg)
	return string(b)
}

// Decode parses Encode's output.
func Decode(s string) (Target, error) {
	var tg Target
	err := json.Unmarshal([]byte(s), &tg)
	return tg, err
}

// Env is an opened Target.
type Env struct {
	Target
	Store idem.Store
	pool  *pgxpool.Pool
	db    *sql.DB
}

// Open opens tg and creates its tables when missing.
func Open(ctx context.Context, tg Target) (*Env, error) {
	e := &Env{Target: tg}
	ddl := fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (msg_id TEXT NOT NULL, payload TEXT NOT NULL)`, tg.Orders)
	switch tg.Kind {
	case "postgres":
		pool, err := pgxpool.New(ctx, tg.URL)
		if err != nil {
			return nil, err
		}
		e.pool = pool
		s, err := pgstore.New(pool, &pgstore.Config{Table: tg.Table})
		if err != nil {
			pool.Close()
			return nil, err
		}
		if err := s.Migrate(ctx); err != nil {
			pool.Close()
			return nil, err
		}
		if _, err := pool.Exec(ctx, ddl); err != nil {
			pool.Close()
			return nil, err
		}
		e.Store = s
	case "sqlite":
		db, err := embedded.Open(tg.URL)
		if err != nil {
			return nil, err
		}
		e.db = db
		s, err := sqlitestore.New(db, &sqlitestore.Config{Table: tg.Table})
		if err != nil {
			db.Close()
			return nil, err
		}
		if err := s.Migrate(ctx); err != nil {
			db.Close()
			return nil, err
		}
		if _, err := db.ExecContext(ctx, ddl); err != nil {
			db.Close()
			return nil, err
		}
		e.Store = s
	default:
		return nil, fmt.Errorf("prooftest: unknown kind %q", tg.Kind)
	}
	return e, nil
}

// Close closes the connections; with Drop it also drops the PostgreSQL tables.
func (e *Env) Close(drop bool) {
	if e.pool != nil {
		if drop {
			_, _ = e.pool.Exec(context.Background(), fmt.Sprintf(`DROP TABLE IF EXISTS %s; DROP TABLE IF EXISTS %s; DROP TABLE IF EXISTS %s_def`, e.Orders, e.Table, e.Orders))
		}
		e.pool.Close()
	}
	if e.db != nil {
		_ = e.db.Close()
	}
}

// Insert is the business handler: one row per message, through the store's
// transaction (and it returns an error when there is none).
func (e *Env) Insert(ctx context.Context, m *consumer.Message) ([]byte, error) {
	q := fmt.Sprintf(`INSERT INTO %s (msg_id, payload) VALUES ($1, $2)`, e.Orders)
	switch {
	case e.pool != nil:
		tx := pgstore.Tx(ctx)
		if tx == nil {
			return nil, errors.New("no transaction in the context")
		}
		_, err := tx.Exec(ctx, q, m.ID, string(m.Payload))
		return nil, err
	default:
		tx := sqlitestore.Tx(ctx)
		if tx == nil {
			return nil, errors.New("no transaction in the context")
		}
		_, err := tx.ExecContext(ctx, q, m.ID, string(m.Payload))
		return nil, err
	}
}

// InsertPlain inserts one row in a transaction of its own, with no dedupe: the
// control consumer's handler.
func (e *Env) InsertPlain(ctx context.Context, m *consumer.Message) error {
	q := fmt.Sprintf(`INSERT INTO %s (msg_id, payload) VALUES ($1, $2)`, e.Orders)
	if e.pool != nil {
		_, err := e.pool.Exec(ctx, q, m.ID, string(m.Payload))
		return err
	}
	_, err := e.db.ExecContext(ctx, q, m.ID, string(m.Payload))
	return err
}

// Count returns the number of rows and of distinct message IDs.
func (e *Env) Count(ctx context.Context) (rows, distinct int, err error) {
	q := fmt.Sprintf(`SELECT count(*), count(DISTINCT msg_id) FROM %s`, e.Orders)
	if e.pool != nil {
		err = e.pool.QueryRow(ctx, q).Scan(&rows, &distinct)
	} else {
		err = e.db.QueryRowContext(ctx, q).Scan(&rows, &distinct)
	}
	return rows, distinct, err
}

// ChildEnv is the environment variable that carries a child's instructions.
const ChildEnv = "IDEM_CONSUMER_PROOF_CHILD"

// IsChild reports whether this process is a re-executed child.
func IsChild() bool { return os.Getenv(ChildEnv) != "" }

// CreateRefusedAtCommit creates the tables InsertRefusedAtCommit writes to: a
// constraint the database checks only at COMMIT (a DEFERRABLE unique key in
// PostgreSQL, a deferred foreign key in SQLite), already bound to fail.
func (e *Env) CreateRefusedAtCommit(ctx context.Context) error {
	if e.pool != nil {
		_, err := e.pool.Exec(ctx, fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s_def (v INT, CONSTRAINT %s_def_u UNIQUE (v) DEFERRABLE INITIALLY DEFERRED); INSERT INTO %s_def VALUES (1)`, e.Orders, e.Orders, e.Orders))
		return err
	}
	_, err := e.db.ExecContext(ctx, fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s_parent (id INTEGER PRIMARY KEY); CREATE TABLE IF NOT EXISTS %s_child (pid INTEGER REFERENCES %s_parent(id) DEFERRABLE INITIALLY DEFERRED)`, e.Orders, e.Orders, e.Orders))
	return err
}

// InsertRefusedAtCommit is a handler whose statements succeed and whose
// transaction the database refuses at COMMIT, every time.
func (e *Env) InsertRefusedAtCommit(ctx context.Context, m *consumer.Message) ([]byte, error) {
	if e.pool != nil {
		tx := pgstore.Tx(ctx)
		if tx == nil {
			return nil, errors.New("no transaction in the context")
		}
		_, err := tx.Exec(ctx, fmt.Sprintf(`INSERT INTO %s_def VALUES (1)`, e.Orders))
		return nil, err
	}
	tx := sqlitestore.Tx(ctx)
	if tx == nil {
		return nil, errors.New("no transaction in the context")
	}
	_, err := tx.ExecContext(ctx, fmt.Sprintf(`INSERT INTO %s_child VALUES (42)`, e.Orders))
	return nil, err
}
