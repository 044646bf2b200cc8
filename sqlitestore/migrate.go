package sqlitestore

import (
	"context"
	"embed"
	"io/fs"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/migrations"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the schema migrations, NNN_name.up.sql and NNN_name.down.sql,
// numbered from 001. They are templates: {{table}} stands for the quoted table
// name (Config.Table) and {{name}} for the bare one. Migrate applies them; they
// are exported for tools that manage schemas themselves.
var Migrations fs.FS = migrations.Sub(migrationFiles, "migrations")

// MigrationsTable is the table in which Migrate records the applied versions of
// every records table in the database.
const MigrationsTable = "idem_migrations"

type migration struct {
	version int
	name    string
	sql     string
}

func upMigrations() ([]migration, error) {
	files, err := migrations.Up(Migrations)
	if err != nil {
		return nil, err
	}
	ms := make([]migration, len(files))
	for i, f := range files {
		ms[i] = migration{version: f.Version, name: f.Name, sql: f.SQL}
	}
	return ms, nil
}

// render fills the placeholders of a migration for the store's table.
func (s *Store) render(sql string) string {
	return strings.NewReplacer("{{table}}", quoteIdent(s.table), "{{name}}", s.table).Replace(sql)
}

// Migrate brings the store's table to the newest schema version, applying the
// missing migrations of Migrations in one transaction that holds the write lock,
// and records them in the idem_migrations table. It is idempotent, and safe to
// run from several processes at once: the later ones find nothing to do.
func (s *Store) Migrate(ctx context.Context) error {
	ms, err := upMigrations()
	if err != nil {
		return wrap("migrate", err)
	}
	unlock, err := s.gate.lock(ctx, s.lockTimeout)
	if err != nil {
		return wrap("migrate", err)
	}
	defer unlock()
	if _, err := s.db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS `+MigrationsTable+` (
    table_name TEXT    NOT NULL,
    version    INTEGER NOT NULL,
    name       TEXT    NOT NULL,
    applied_at INTEGER NOT NULL, -- Unix nanoseconds
    PRIMARY KEY (table_name, version)
)`); err != nil {
		return wrap("migrate: create "+MigrationsTable, err)
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return wrap("migrate: begin", err)
	}
	defer func() { _ = tx.Rollback() }()
	// Take the write lock before reading, so that a concurrent Migrate waits here
	// and then sees what this one applied.
	if _, err := tx.ExecContext(ctx, `UPDATE `+MigrationsTable+` SET version = version WHERE 0`); err != nil {
		return wrap("migrate: take the write lock", err)
	}
	applied := map[int]bool{}
	rows, err := tx.QueryContext(ctx, `SELECT version FROM `+MigrationsTable+` WHERE table_name = ?`, s.table)
	if err != nil {
		return wrap("migrate: read applied versions", err)
	}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			_ = rows.Close()
			return wrap("migrate: read applied versions", err)
		}
		applied[v] = true
	}
	if err := rows.Err(); err != nil {
		return wrap("migrate: read applied versions", err)
	}
	for _, m := range ms {
		if applied[m.version] {
			continue
		}
		if _, err := tx.ExecContext(ctx, s.render(m.sql)); err != nil {
			return wrap("migrate: apply "+m.name, err)
		}
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+MigrationsTable+` (table_name, version, name, applied_at) VALUES (?, ?, ?, ?)`,
			s.table, m.version, m.name, time.Now().UnixNano()); err != nil {
			return wrap("migrate: record "+m.name, err)
		}
	}
	if err := tx.Commit(); err != nil {
		return wrap("migrate: commit", err)
	}
	return nil
}
