package redisstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/replaytest"
)

// TestReplayFidelity runs replaytest.Fidelity on Redis: a retry gets the
// first answer's status, stored headers and body bytes.
func TestReplayFidelity(t *testing.T) {
	t.Parallel()
	replaytest.Fidelity(t, func(t *testing.T) idem.Store { return setup(t).store }, idem.FlowClaimComplete)
}
