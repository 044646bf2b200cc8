package mysqlstore

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"strings"
	"time"

	"github.com/idemkit/idem/internal/migrations"
)

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migrations holds the versioned schema migrations Migrate applies, as files named
// NNN_name.up.sql and NNN_name.down.sql at the root of the FS. In them, {{table}}
// stands for the records table, quoted with backticks, and {{steps}} for the step
// records' table (the records table's name with "_steps"); replace them when
// applying them with another tool.
var Migrations fs.FS = migrations.Sub(migrationFiles, "migrations")

// migrateLockWait is how long Migrate waits for a concurrent Migrate to finish.
const migrateLockWait = 60 // seconds

type migration struct {
	version int
	name    string
	sql     string
}

func loadMigrations() ([]migration, error) {
	files, err := migrations.Up(Migrations)
	if err != nil {
		return nil, fmt.Errorf("mysqlstore: %w", err)
	}
	ms := make([]migration, len(files))
	for i, f := range files {
		ms[i] = migration{version: f.Version, name: strings.TrimSuffix(f.Name, ".up.sql"), sql: f.SQL}
	}
	return ms, nil
}

// Migrate brings the schema up to date: it creates the records table (and
// Table+"_migrations", which records the versions applied) and applies every
// migration in Migrations not applied yet. It is idempotent, and safe to run from
// many processes at once: they serialise on a named lock (GET_LOCK) on one
// connection, and each migration is written so that re-running it after a crash
// half-way is harmless.
//
// The database user needs CREATE (and, for later migrations, ALTER) on the
// database, besides SELECT, INSERT, UPDATE and DELETE on the tables.
func (s *Store) Migrate(ctx context.Context) error {
	ms, err := loadMigrations()
	if err != nil {
		return err
	}
	conn, err := s.db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("mysqlstore: migrate: %w", err)
	}
	defer conn.Close()

	// GET_LOCK names are at most 64 characters; hash database and table into one.
	const lockName = "CONCAT('idem_migrate:', LEFT(SHA2(CONCAT(IFNULL(DATABASE(), ''), '.', ?), 256), 32))"
	var got sql.NullInt64
	if err := conn.QueryRowContext(ctx, "SELECT GET_LOCK("+lockName+", ?)", s.table, migrateLockWait).Scan(&got); err != nil {
		return fmt.Errorf("mysqlstore: migrate: taking the migration lock: %w", err)
	}
	if !got.Valid || got.Int64 != 1 {
		return fmt.Errorf("mysqlstore: migrate: another Migrate of table %s held the migration lock for %d s; wait for it to finish (or find the session holding it with SELECT * FROM information_schema.METADATA_LOCK_INFO on MariaDB, performance_schema.metadata_locks on MySQL) and run Migrate again", quote(s.table), migrateLockWait)
	}
	defer func() {
		// Release even when ctx has ended; closing the connection would too.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		_, _ = conn.ExecContext(rctx, "DO RELEASE_LOCK("+lockName+")", s.table)
	}()

	vt := quote(s.table + "_migrations")
	if _, err := conn.ExecContext(ctx, "CREATE TABLE IF NOT EXISTS "+vt+
		" (`version` INT NOT NULL PRIMARY KEY, `name` VARCHAR(255) NOT NULL, `applied_at` BIGINT NOT NULL) ENGINE=InnoDB"); err != nil {
		return fmt.Errorf("mysqlstore: migrate: creating %s: %w (the user needs the CREATE privilege on the database)", vt, err)
	}
	applied := map[int]bool{}
	rows, err := conn.QueryContext(ctx, "SELECT `version` FROM "+vt)
	if err != nil {
		return fmt.Errorf("mysqlstore: migrate: reading %s: %w", vt, err)
	}
	for rows.Next() {
		var v int
		if err := rows.Scan(&v); err != nil {
			rows.Close()
			return fmt.Errorf("mysqlstore: migrate: reading %s: %w", vt, err)
		}
		applied[v] = true
	}
	if err := errors.Join(rows.Err(), rows.Close()); err != nil {
		return fmt.Errorf("mysqlstore: migrate: reading %s: %w", vt, err)
	}
	for _, m := range ms {
		if applied[m.version] {
			continue
		}
		// DDL commits implicitly in MySQL, so a migration and its bookkeeping row
		// cannot share a transaction: migrations are idempotent instead.
		for _, stmt := range splitStatements(strings.NewReplacer("{{table}}", quote(s.table), "{{steps}}", quote(s.table+stepsSuffix)).Replace(m.sql)) {
			if _, err := conn.ExecContext(ctx, stmt); err != nil {
				if code, ok := errorNumber(err); ok && code == 1060 && strings.Contains(stmt, "ADD COLUMN") {
					// The column is there: a run that crashed after adding it
					// and before recording the migration (MySQL has no ADD
					// COLUMN IF NOT EXISTS).
					continue
				}
				return fmt.Errorf("mysqlstore: migrate: applying %s: %w", m.name, err)
			}
		}
		if _, err := conn.ExecContext(ctx, "INSERT INTO "+vt+" (`version`, `name`, `applied_at`) VALUES (?, ?, ?)",
			m.version, m.name, time.Now().UnixMicro()); err != nil {
			return fmt.Errorf("mysqlstore: migrate: recording %s: %w", m.name, err)
		}
	}
	return nil
}

// splitStatements splits a migration file on semicolons that end a line, and
// drops comment-only and empty statements.
func splitStatements(src string) []string {
	var out []string
	for _, part := range strings.Split(src, ";\n") {
		var b strings.Builder
		for _, line := range strings.Split(part, "\n") {
			if t := strings.TrimSpace(line); t == "" || strings.HasPrefix(t, "--") {
				continue
			}
			b.WriteString(line)
			b.WriteByte('\n')
		}
		if stmt := strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(b.String()), ";")); stmt != "" {
			out = append(out, stmt)
		}
	}
	return out
}
