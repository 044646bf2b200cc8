package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestInspectStepFingerprint: a key released after its request recorded a
// step (no record, the step kept) — idem inspect shows the fingerprint of
// the request the step belongs to and says that a request with another gets
// 422, instead of only "the next one finds these steps"; idem resolve --step
// --done keeps the fingerprint. Failed before: the fingerprint was not shown.
func TestInspectStepFingerprint(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "keys.db")
	s := sqliteKeyStore(t, path, nil)
	const fp = "v3:0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	ctx := context.Background()
	now := time.Now()
	scope := idem.StoredScope("acme")
	if _, began, err := s.BeginStep(ctx, idem.BeginStepRequest{Scope: scope, Key: "k1", Name: "charge", Owner: "own",
		DerivedKey: "idem_dk_k1", Fingerprint: fp, Now: now, ExpiresAt: now.Add(time.Hour)}); err != nil || !began {
		t.Fatalf("BeginStep: %v %v", began, err)
	}
	if err := s.FinishStep(ctx, scope, "k1", "charge", "own", idem.StepDone, []byte(`{"id":"ch_1"}`), now); err != nil {
		t.Fatal(err)
	}
	code, out, stderr := runIdem(t, t.TempDir(), nil, "inspect", "--db", "sqlite:"+path, "--scope", "acme", "k1")
	if code != exitOK || !strings.Contains(out, fp) || !strings.Contains(out, "422") {
		t.Errorf("inspect: exit %d; want the step's request fingerprint %s and the 422 a different request gets:\n%s%s", code, fp, out, stderr)
	}
	if code, out, stderr := runIdem(t, t.TempDir(), nil, "resolve", "--db", "sqlite:"+path, "--scope", "acme", "--step", "charge", "--done", `{"id":"ch_2"}`, "k1"); code != exitOK {
		t.Fatalf("resolve --step: exit %d:\n%s%s", code, out, stderr)
	}
	recs, err := s.GetSteps(ctx, scope, "k1", time.Now())
	if err != nil || len(recs) != 1 || recs[0].Fingerprint != fp || string(recs[0].Result) != `{"id":"ch_2"}` {
		t.Errorf("after resolve --step --done: %+v %v; want the new result under the same fingerprint", recs, err)
	}
}
