package idem_test

import (
	"testing"

	"github.com/idemkit/idem/internal/replaytest"
)

// TestReplayFidelity: replaytest.Fidelity on memstore and on SQLite in both
// flows (PostgreSQL and MariaDB run it in their packages).
func TestReplayFidelity(t *testing.T) {
	t.Parallel()
	onLocalStores(t, replaytest.Fidelity)
}
