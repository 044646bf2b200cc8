package mysqlstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/replaytest"
)

// TestReplayFidelity runs replaytest.Fidelity on MySQL/MariaDB in both flows:
// a retry gets the first answer's status, stored headers and body bytes.
func TestReplayFidelity(t *testing.T) {
	t.Parallel()
	for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
		t.Run(flow.String(), func(t *testing.T) {
			t.Parallel()
			db := openDB(t, 4, "")
			replaytest.Fidelity(t, func(t *testing.T) idem.Store { return newStore(t, db) }, flow)
		})
	}
}
