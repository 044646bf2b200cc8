package consumer_test

import (
	"context"
	"database/sql"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/consumer/internal/prooftest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore"
)

// newMySQL returns a migrated mysqlstore on a table of its own, dropped at the end.
func newMySQL(t *testing.T) *mysqlstore.Store {
	t.Helper()
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	table := "idem_c2_" + prooftest.Rand()
	s, err := mysqlstore.New(db, &mysqlstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = s.Close()
		for _, tb := range []string{table, table + "_migrations"} {
			_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+tb+"`")
		}
	})
	return s
}
