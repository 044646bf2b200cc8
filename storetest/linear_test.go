package storetest_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/storetest"
)

// racyClaimStore is memstore with a claim that checks, then writes: it reads the
// record, sleeps a little, and then writes its own claim over whatever is there
// (releasing an in-flight holder it finds meanwhile), reporting success.
type racyClaimStore struct{ *memstore.Store }

func (s racyClaimStore) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	rec, err := s.Get(ctx, req.Scope, req.Key, req.Now)
	switch {
	case errors.Is(err, idem.ErrNotFound):
	case err != nil:
		return nil, false, err
	case rec.State == idem.StateInFlight && !rec.LeaseUntil.After(req.Now) && rec.Fingerprint == req.Fingerprint:
		return s.Store.Claim(ctx, req) // a takeover goes through the real claim
	default:
		return rec, false, nil
	}
	time.Sleep(200 * time.Microsecond) // the window between the check and the write
	got, claimed, err := s.Store.Claim(ctx, req)
	if err != nil || claimed {
		return got, claimed, err
	}
	// Someone claimed it in the window: the unconditional write replaces it.
	if got.State == idem.StateInFlight {
		_ = s.Release(ctx, req.Scope, req.Key, got.Token)
		if got, claimed, err := s.Store.Claim(ctx, req); err != nil || claimed {
			return got, claimed, err
		}
	}
	return &idem.Record{Scope: req.Scope, Key: req.Key, State: idem.StateInFlight, Fingerprint: req.Fingerprint,
		Token: req.Token, CreatedAt: req.Now, LeaseUntil: req.LeaseUntil, ExpiresAt: req.ExpiresAt}, true, nil
}

// unfencedCompleteStore is memstore with a Complete that does not compare the
// token: it completes whatever in-flight record it finds.
type unfencedCompleteStore struct{ *memstore.Store }

func (s unfencedCompleteStore) Complete(ctx context.Context, scope, key, _ string, resp *idem.Response, now, expiresAt time.Time) error {
	rec, err := s.Get(ctx, scope, key, now)
	if err != nil {
		if errors.Is(err, idem.ErrNotFound) {
			return idem.ErrLockLost
		}
		return err
	}
	return s.Store.Complete(ctx, scope, key, rec.Token, resp, now, expiresAt)
}

// shortExtendStore is memstore with an Extend that moves the lease but not the
// expiry (redisstore's bug before 14397b0): a renewal past the TTL leaves the
// record to expire under its live lease.
type shortExtendStore struct{ *memstore.Store }

func (s shortExtendStore) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	rec, err := s.Get(ctx, scope, key, time.Time{})
	if err != nil || rec.State != idem.StateInFlight || rec.Token != token {
		return idem.ErrLockLost
	}
	if err := s.Store.Extend(ctx, scope, key, token, now, leaseUntil); err != nil {
		return err
	}
	if leaseUntil.After(rec.ExpiresAt) {
		// Put the old expiry back: release and re-claim with the same token.
		if err := s.Release(ctx, scope, key, token); err != nil {
			return err
		}
		_, _, err := s.Store.Claim(ctx, idem.ClaimRequest{Scope: scope, Key: key, Fingerprint: rec.Fingerprint, Token: token,
			Now: rec.CreatedAt, LeaseUntil: leaseUntil, ExpiresAt: rec.ExpiresAt})
		return err
	}
	return nil
}

func newMem(t *testing.T) *memstore.Store {
	s := memstore.New(&memstore.Config{JanitorInterval: -1})
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// The checker finds a planted bug, and says where: a counterexample in the
// message and porcupine's visualisation on disk.
func TestLinearizabilityFindsPlantedBugs(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		store func(t *testing.T) idem.Store
	}{
		{"check-then-write claim", func(t *testing.T) idem.Store { return racyClaimStore{newMem(t)} }},
		{"complete without the fence", func(t *testing.T) idem.Store { return unfencedCompleteStore{newMem(t)} }},
		{"extend that keeps the expiry", func(t *testing.T) idem.Store { return shortExtendStore{newMem(t)} }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			res, err := storetest.CheckLinearizability(context.Background(), tc.store(t), storetest.LinearizabilityOptions{Ops: 20000})
			if err != nil {
				t.Fatal(err)
			}
			if res.Linearizable {
				t.Fatalf("the planted bug was not found in %d operations (%v)", res.Ops, res.Counts)
			}
			t.Logf("found after %v:\n%s\nvisualisation: %s", res.Duration, res.Problem, res.Visualization)
			if !strings.Contains(res.Problem, "NOT linearizable") || !strings.Contains(res.Problem, "can come next") {
				t.Errorf("the problem does not read as a counterexample: %s", res.Problem)
			}
			fi, err := os.Stat(res.Visualization)
			if err != nil {
				t.Fatalf("visualisation %q: %v", res.Visualization, err)
			}
			if fi.Size() == 0 {
				t.Errorf("visualisation %q is empty", res.Visualization)
			}
			_ = os.RemoveAll(strings.TrimSuffix(res.Visualization, "/history.html"))
		})
	}
}

// The correct store passes the same check (so the planted bugs above are found
// for what they are, not for a model that refuses everything).
func TestLinearizabilityMemstore(t *testing.T) {
	t.Parallel()
	storetest.RunLinearizability(t, newMem(t), &storetest.LinearizabilityOptions{Ops: 2000})
}
