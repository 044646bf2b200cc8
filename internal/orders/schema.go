package orders

import (
	"context"
	"fmt"
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
	created_at  TIMESTAMPTZ NOT NULL
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
	created_at  TEXT NOT NULL
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
		return nil
	})
	if err != nil {
		return fmt.Errorf("orders: create table %s: %w", s.cfg.Table, err)
	}
	return nil
}
