package orders

import (
	"context"
	"fmt"
	"strings"
)

// Schema returns the statements that create the orders table and its index in
// the backend's dialect. Each is idempotent (IF NOT EXISTS).
func (s *Service) Schema() []string {
	t, idx := s.cfg.Table, s.bare+"_tenant_cart_idx"
	switch s.b.Dialect() {
	case Postgres:
		return []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	id          TEXT PRIMARY KEY,
	tenant      TEXT NOT NULL,
	cart_id     TEXT NOT NULL,
	total_cents BIGINT NOT NULL CHECK (total_cents >= 0),
	created_at  TIMESTAMPTZ NOT NULL,
	charge_id   TEXT
)`,
			`CREATE INDEX IF NOT EXISTS ` + idx + ` ON ` + t + ` (tenant, cart_id, created_at)`,
		}
	case MySQL:
		return []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	id          VARCHAR(64) NOT NULL PRIMARY KEY,
	tenant      VARCHAR(255) NOT NULL,
	cart_id     VARCHAR(255) NOT NULL,
	total_cents BIGINT NOT NULL,
	created_at  DATETIME(6) NOT NULL,
	charge_id   VARCHAR(255) NULL,
	INDEX ` + idx + ` (tenant, cart_id, created_at)
) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin`,
		}
	default: // SQLite
		return []string{
			`CREATE TABLE IF NOT EXISTS ` + t + ` (
	id          TEXT PRIMARY KEY,
	tenant      TEXT NOT NULL,
	cart_id     TEXT NOT NULL,
	total_cents INTEGER NOT NULL CHECK (total_cents >= 0),
	created_at  TEXT NOT NULL,
	charge_id   TEXT
)`,
			`CREATE INDEX IF NOT EXISTS ` + idx + ` ON ` + t + ` (tenant, cart_id, created_at)`,
		}
	}
}

// Migrate creates the orders table and its index if they do not exist. It is
// safe to run again, and, on PostgreSQL, from several processes at once (it
// takes an advisory lock).
func (s *Service) Migrate(ctx context.Context) error {
	err := s.b.inTx(ctx, func(q querier) error {
		if s.b.Dialect() == Postgres {
			if err := q.exec(ctx, "SELECT pg_advisory_xact_lock(hashtext('idem.orders.migrate'))"); err != nil {
				return err
			}
		}
		for _, stmt := range s.Schema() {
			if err := q.exec(ctx, stmt); err != nil {
				return err
			}
		}
		return s.addChargeID(ctx, q)
	})
	if err != nil {
		return fmt.Errorf("orders: create table %s: %w", s.cfg.Table, err)
	}
	return nil
}

// addChargeID adds the charge_id column to an orders table created before it
// existed (idem demo before --payment-url); a table that has it is left alone.
func (s *Service) addChargeID(ctx context.Context, q querier) error {
	var probe string
	var args []any
	switch s.b.Dialect() {
	case Postgres:
		// IF NOT EXISTS, under the migration's advisory lock.
		return q.exec(ctx, "ALTER TABLE "+s.cfg.Table+" ADD COLUMN IF NOT EXISTS charge_id TEXT")
	case MySQL:
		schema := "DATABASE()"
		if parts := strings.Split(s.cfg.Table, "."); len(parts) == 2 {
			schema = "?"
			args = append(args, parts[0])
		}
		probe = "SELECT count(*) FROM information_schema.columns WHERE table_schema = " + schema + " AND table_name = ? AND column_name = 'charge_id'"
		args = append(args, s.bare)
	default:
		probe = "SELECT count(*) FROM pragma_table_info(?) WHERE name = 'charge_id'"
		args = append(args, s.bare)
	}
	n := 0
	if err := q.query(ctx, probe, args, func(scan func(...any) error) error { return scan(&n) }); err != nil {
		return fmt.Errorf("looking for the charge_id column: %w", err)
	}
	if n > 0 {
		return nil
	}
	typ := "TEXT"
	if s.b.Dialect() == MySQL {
		typ = "VARCHAR(255) NULL"
	}
	err := q.exec(ctx, "ALTER TABLE "+s.cfg.Table+" ADD COLUMN charge_id "+typ)
	if err != nil && strings.Contains(strings.ToLower(err.Error()), "duplicate column") {
		return nil // another process added it meanwhile (MySQL's DDL is not transactional)
	}
	return err
}
