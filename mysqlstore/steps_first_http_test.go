package mysqlstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/steptest"
)

// TestStepOtherRequestFirstStepNeverRecorded: the step names depend on the
// body (reserve-<item>). A request for item a reserves it as a step and
// answers 503 (not kept: the key is released, the step's record stays). The
// key is then sent for item b, whose first step, reserve-b, is one the first
// request never recorded: it is not run, the answer is 422
// idempotency_key_reused, and nothing is stored (no record of reserve-b, the
// key free); the first request, retried as it was sent, recovers (201, one
// provider call in all). On MariaDB, both flows. Failed before: reserve-b ran
// before the 422 of the later step, and its record stayed.
func TestStepOtherRequestFirstStepNeverRecorded(t *testing.T) {
	bothModes(t, func(t *testing.T) {
		for _, flow := range []idem.Flow{idem.FlowClaimComplete, idem.FlowSingleTx} {
			t.Run(flow.String(), func(t *testing.T) {
				t.Parallel()
				steptest.OtherRequestFirstStep(t, newStore(t, openDB(t, 8, "")), flow)
			})
		}
	})
}
