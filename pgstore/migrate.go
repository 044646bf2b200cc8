package pgstore

import (
	"context"
	"embed"
	"fmt"
	"io/fs"
	"strings"

	"github.com/idemkit/idem/internal/migrations"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the versioned migration files (001_create.up.sql,
// 001_create.down.sql, 002_create_steps.up.sql, …) for users of goose,
// golang-migrate or atlas. They are written for the default table names,
// idem_records and idem_records_steps (the step records); Store.Migrate applies
// the up files to the configured table (Table and StepsTable).
var Migrations fs.FS = migrations.Sub(migrationFiles, "migrations")

// migrateLockKey is the advisory lock that serialises Migrate calls (any table).
const migrateLockKey = int64(0x6964656d_70676d67) // "idempgmg"

// Migrate creates or upgrades the store's table and index. It is idempotent and
// safe to run from many processes at once: it applies every up migration, each of
// which is written to be re-run, in one transaction under an advisory lock.
// Migrate never creates a schema: for a schema-qualified Config.Table such as
// "billing.idem_records", the schema must exist (CREATE SCHEMA IF NOT EXISTS
// billing first, as idem migrate --schema does), or Migrate fails.
func (s *Store) Migrate(ctx context.Context) error {
	files, err := migrations.Up(Migrations)
	if err != nil {
		return fmt.Errorf("pgstore: %w", err)
	}
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return fmt.Errorf("pgstore: migrate: %w", err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", migrateLockKey); err != nil {
		return fmt.Errorf("pgstore: migrate: take the migration lock: %w", err)
	}
	for _, f := range files {
		if _, err := tx.Exec(ctx, s.rewrite(f.SQL)); err != nil {
			return fmt.Errorf("pgstore: migrate %s: apply %s: %w (does the schema exist, and may this role create tables in it?)", s.table, f.Name, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("pgstore: migrate: commit: %w", err)
	}
	return nil
}

// rewrite points a migration written for idem_records at the store's table.
func (s *Store) rewrite(sql string) string {
	return strings.NewReplacer(
		"idem_records_steps_expires_at_idx", s.steps.index,
		"idem_records_steps", s.steps.table,
		"idem_records_expires_at_idx", s.index,
		DefaultTable, s.table,
	).Replace(sql)
}
