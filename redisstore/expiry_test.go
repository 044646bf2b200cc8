package redisstore_test

import (
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/expirytest"
)

// TestExpiryBoundary runs expirytest.Boundary on Redis: a complete record
// reaching ExpiresAt (by the middleware's clock; Redis's own expiry is an hour
// away) while duplicates on servers 1 ms apart and janitors race for it.
func TestExpiryBoundary(t *testing.T) {
	t.Parallel()
	expirytest.Boundary(t, func(t *testing.T) idem.Store { return setup(t).store }, idem.FlowClaimComplete)
}
