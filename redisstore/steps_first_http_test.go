package redisstore_test

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
// provider call in all). On Redis. Failed before: reserve-b ran before the 422
// of the later step, and its record stayed.
func TestStepOtherRequestFirstStepNeverRecorded(t *testing.T) {
	b := setup(t)
	steptest.OtherRequestFirstStep(t, b.store, idem.FlowAuto)
}
