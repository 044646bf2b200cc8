package pgstore_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// TestLargestScopeAndKey: the largest scope the core hands a store (128 bytes
// of 4-byte UTF-8 characters) with the largest key (255 visible ASCII bytes)
// goes through both flows.
func TestLargestScopeAndKey(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	scope := strings.Repeat("\U0001D11E", 32) // 𝄞, 4 bytes each
	key := strings.Repeat("~", 255)
	if len(scope) != 128 {
		t.Fatalf("scope is %d bytes", len(scope))
	}
	now := time.Now()
	if _, claimed, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: scope, Key: key, Fingerprint: "v1:" + strings.Repeat("f", 300), Token: "tok",
		Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !claimed {
		t.Fatalf("Claim: %v %v", claimed, err)
	}
	if err := s.Extend(ctx30(t), scope, key, "tok", now, now.Add(2*time.Minute)); err != nil {
		t.Fatalf("Extend: %v", err)
	}
	if err := s.Complete(ctx30(t), scope, key, "tok", &idem.Response{Status: 201, Body: []byte("ok")}, now, now.Add(time.Hour)); err != nil {
		t.Fatalf("Complete: %v", err)
	}
	if rec, err := s.Get(ctx30(t), scope, key, now); err != nil || rec.Scope != scope || rec.Key != key || string(rec.Response.Body) != "ok" {
		t.Fatalf("Get: %+v, %v", rec, err)
	}
	key2 := strings.Repeat("!", 255)
	_, tx, rec, err := s.BeginLocked(ctx30(t), scope, key2, now)
	if err != nil || rec != nil {
		t.Fatalf("BeginLocked: %+v, %v", rec, err)
	}
	if err := tx.Insert(ctx30(t), &idem.Record{Scope: scope, Key: key2, State: idem.StateComplete, Fingerprint: "v1:f", Token: "t",
		CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(time.Hour), Response: &idem.Response{Status: 201}}); err != nil {
		t.Fatalf("Insert: %v", err)
	}
	if err := tx.Commit(ctx30(t)); err != nil {
		t.Fatalf("Commit: %v", err)
	}
	if rec, err := s.Get(ctx30(t), scope, key2, now); err != nil || rec.Key != key2 {
		t.Fatalf("Get after the single transaction: %+v, %v", rec, err)
	}
}

// TestOversizeScopeAndKey: a scope or key longer than pgstore stores (a caller
// that bypasses idem.New: a 2,800-byte bearer token as scope) fails at once with
// an error that names the limit and does not echo the input; no method of
// either flow reaches PostgreSQL's index row limit.
func TestOversizeScopeAndKey(t *testing.T) {
	t.Parallel()
	db := newTestDB(t, 4)
	s := db.newStore(t)
	now := time.Now()
	raw := make([]byte, 2100)
	_, _ = rand.Read(raw)
	long := base64.StdEncoding.EncodeToString(raw)[:2800] // incompressible, like a bearer token
	for _, c := range []struct{ name, scope, key string }{
		{"scope", long, "k"},
		{"key", "s", long},
	} {
		check := func(op string, err error) {
			t.Helper()
			if err == nil {
				t.Errorf("%s with a %d-byte %s succeeded, want an error", op, len(long), c.name)
				return
			}
			msg := err.Error()
			if strings.Contains(msg, long[:64]) || len(msg) > 400 {
				t.Errorf("%s: the error echoes the input or is %d bytes long: %.200s…", op, len(msg), msg)
			}
			if !strings.Contains(msg, "the "+c.name+" is 2800 bytes") || !strings.Contains(msg, "1024") {
				t.Errorf("%s: error %q does not say the %s is too long and what the limit is", op, msg, c.name)
			}
			if errors.Is(err, idem.ErrNotFound) || errors.Is(err, idem.ErrLockLost) || errors.Is(err, idem.ErrInFlight) {
				t.Errorf("%s: error %v is a sentinel the middleware acts on", op, err)
			}
		}
		_, _, err := s.Claim(ctx30(t), idem.ClaimRequest{Scope: c.scope, Key: c.key, Fingerprint: "v1:f", Token: "tok",
			Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)})
		check("Claim", err)
		check("Complete", s.Complete(ctx30(t), c.scope, c.key, "tok", &idem.Response{Status: 200}, now, now.Add(time.Hour)))
		check("Extend", s.Extend(ctx30(t), c.scope, c.key, "tok", now, now.Add(time.Hour)))
		check("Release", s.Release(ctx30(t), c.scope, c.key, "tok"))
		_, err = s.Get(ctx30(t), c.scope, c.key, now)
		check("Get", err)
		_, ltx, _, err := s.BeginLocked(ctx30(t), c.scope, c.key, now)
		check("BeginLocked", err)
		if ltx != nil {
			_ = ltx.Rollback(context.Background())
		}
		_, tx, err := s.BeginTx(ctx30(t))
		if err != nil {
			t.Fatal(err)
		}
		check("Tx.Complete", tx.Complete(ctx30(t), c.scope, c.key, "tok", &idem.Response{Status: 200}, now, now.Add(time.Hour)))
		_ = tx.Rollback(context.Background())
	}
	if n := db.count(t, `SELECT count(*) FROM `+s.Table()); n != 0 {
		t.Errorf("%d records written", n)
	}
}
