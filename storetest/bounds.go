package storetest

import (
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// testFieldBounds: every stored field is kept exactly or refused with
// idem.ErrFieldTooLarge (a *idem.FieldTooLargeError naming the field), having
// changed nothing — never cut short, never a failure of another kind. A
// 70,000-byte Ref (past a MySQL BLOB), a 70,000-byte header value, a 2 MiB
// body and a 600-byte fingerprint are tried through Complete, a TxStore's
// transaction and a SingleTxStore's Insert.
func testFieldBounds(t *testing.T, s idem.Store) {
	big := func(n int) string { return strings.Repeat("r", n) }
	cases := []struct {
		field string
		resp  *idem.Response
	}{
		{"ref", &idem.Response{Status: 201, BodyOmitted: true, Ref: big(70_000)}},
		{"headers", &idem.Response{Status: 201, Header: http.Header{"Location": {big(70_000)}}, Body: []byte("h")}},
		{"body", &idem.Response{Status: 201, Body: []byte(big(2 << 20))}},
	}
	// refused checks that err is the field's ErrFieldTooLarge; it reports
	// whether the store refused.
	refused := func(t *testing.T, what, field string, err error) bool {
		t.Helper()
		if err == nil {
			return false
		}
		var fte *idem.FieldTooLargeError
		if !errors.Is(err, idem.ErrFieldTooLarge) || !errors.As(err, &fte) || fte.Field != field {
			t.Fatalf("%s with a large %s: %v; want it stored exactly or an *idem.FieldTooLargeError for %q", what, field, err, field)
		}
		if fte.Size <= fte.Limit || !strings.Contains(err.Error(), field) {
			t.Fatalf("%s: %v does not say the %s is larger than the limit", what, err, field)
		}
		return true
	}
	for _, c := range cases {
		t.Run("Complete/"+c.field, func(t *testing.T) {
			f := newFixture(t)
			now := time.Now()
			req := f.claim("v1:bounds", now, time.Minute, longTTL)
			mustClaim(t, s, req)
			err := s.Complete(ctxFor(t), f.scope, f.key, req.Token, c.resp, now, now.Add(longTTL))
			if refused(t, "Complete", c.field, err) {
				checkInFlight(t, mustGet(t, s, f, now), req)
				small := &idem.Response{Status: 201, Body: []byte("small")}
				if err := s.Complete(ctxFor(t), f.scope, f.key, req.Token, small, now, now.Add(longTTL)); err != nil {
					t.Fatalf("Complete with a small response after the refusal: %v", err)
				}
				checkResponse(t, mustGet(t, s, f, now).Response, small)
				return
			}
			checkResponse(t, mustGet(t, s, f, now).Response, c.resp)
		})
		if ts, ok := s.(idem.TxStore); ok {
			t.Run("Tx/"+c.field, func(t *testing.T) {
				f := newFixture(t)
				now := time.Now()
				req := f.claim("v1:bounds", now, time.Minute, longTTL)
				mustClaim(t, s, req)
				ctx, tx, err := ts.BeginTx(ctxFor(t))
				if err != nil {
					t.Fatalf("BeginTx: %v", err)
				}
				err = tx.Complete(ctx, f.scope, f.key, req.Token, c.resp, now, now.Add(longTTL))
				if err == nil {
					err = tx.Commit(ctx)
				}
				_ = tx.Rollback(ctxFor(t))
				if refused(t, "Tx.Complete and Commit", c.field, err) {
					checkInFlight(t, mustGet(t, s, f, now), req)
					return
				}
				checkResponse(t, mustGet(t, s, f, now).Response, c.resp)
			})
		}
		if ls, ok := s.(idem.SingleTxStore); ok {
			t.Run("Insert/"+c.field, func(t *testing.T) {
				f := newFixture(t)
				now := time.Now()
				ctx, tx, rec, err := ls.BeginLocked(ctxFor(t), f.scope, f.key, now)
				if err != nil || rec != nil {
					t.Fatalf("BeginLocked: %+v, %v", rec, err)
				}
				err = tx.Insert(ctx, &idem.Record{Scope: f.scope, Key: f.key, State: idem.StateComplete, Fingerprint: "v1:bounds",
					Token: "tok-" + randToken(), CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(longTTL), Response: c.resp})
				if err == nil {
					err = tx.Commit(ctx)
				}
				_ = tx.Rollback(ctxFor(t))
				if refused(t, "Insert and Commit", c.field, err) {
					wantNotFound(t, s, f, now)
					return
				}
				checkResponse(t, mustGet(t, s, f, now).Response, c.resp)
			})
		}
	}
	t.Run("Claim/fingerprint", func(t *testing.T) {
		f := newFixture(t)
		now := time.Now()
		req := f.claim("v1:"+big(600), now, time.Minute, longTTL)
		_, claimed, err := s.Claim(ctxFor(t), req)
		if refused(t, "Claim", "fingerprint", err) {
			wantNotFound(t, s, f, now)
			return
		}
		if !claimed {
			t.Fatal("Claim of an absent key with a long fingerprint: not claimed")
		}
		checkInFlight(t, mustGet(t, s, f, now), req)
	})
}
