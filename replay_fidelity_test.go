package idem_test

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/replaytest"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// TestReplayFidelity: replaytest.Fidelity on memstore and on SQLite in both
// flows (PostgreSQL and MariaDB run it in their packages).
func TestReplayFidelity(t *testing.T) {
	t.Parallel()
	t.Run("memstore", func(t *testing.T) {
		t.Parallel()
		replaytest.Fidelity(t, func(t *testing.T) idem.Store {
			s := memstore.New(nil)
			t.Cleanup(func() { _ = s.Close() })
			return s
		}, idem.FlowAuto)
	})
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(fmt.Sprintf("sqlite-flow%d", flow), func(t *testing.T) {
			t.Parallel()
			replaytest.Fidelity(t, func(t *testing.T) idem.Store {
				db, err := embedded.Open(filepath.Join(t.TempDir(), "replay.db"))
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = db.Close() })
				s, err := sqlitestore.New(db, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := s.Migrate(context.Background()); err != nil {
					t.Fatal(err)
				}
				return s
			}, flow)
		})
	}
}
