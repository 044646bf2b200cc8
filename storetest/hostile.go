package storetest

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
)

// completions are the ways a store keeps a response: Complete, and when the
// store has them, a transaction's Complete and a locked transaction's Insert.
// A function returns the token the record was completed under ("" for Insert,
// whose records are complete from the start).
func completions(t *testing.T, s idem.Store) map[string]func(f fixture, resp *idem.Response, now time.Time) (string, error) {
	claim := func(f fixture, now time.Time) string {
		req := f.claim("v1:hostile", now, time.Minute, longTTL)
		mustClaim(t, s, req)
		return req.Token
	}
	m := map[string]func(f fixture, resp *idem.Response, now time.Time) (string, error){
		"Complete": func(f fixture, resp *idem.Response, now time.Time) (string, error) {
			token := claim(f, now)
			return token, s.Complete(ctxFor(t), f.scope, f.key, token, resp, now, now.Add(longTTL))
		},
	}
	if ts, ok := s.(idem.TxStore); ok {
		m["Tx.Complete"] = func(f fixture, resp *idem.Response, now time.Time) (string, error) {
			token := claim(f, now)
			ctx, tx, err := ts.BeginTx(ctxFor(t))
			if err != nil {
				return token, err
			}
			defer func() { _ = tx.Rollback(ctxFor(t)) }()
			if err := tx.Complete(ctx, f.scope, f.key, token, resp, now, now.Add(longTTL)); err != nil {
				return token, err
			}
			return token, tx.Commit(ctx)
		}
	}
	if ls, ok := s.(idem.SingleTxStore); ok {
		m["LockedTx.Insert"] = func(f fixture, resp *idem.Response, now time.Time) (string, error) {
			ctx, tx, rec, err := ls.BeginLocked(ctxFor(t), f.scope, f.key, now)
			if err != nil {
				return "", err
			}
			defer func() { _ = tx.Rollback(ctxFor(t)) }()
			if rec != nil {
				return "", fmt.Errorf("BeginLocked found a record on a fresh key: %+v", rec)
			}
			err = tx.Insert(ctx, &idem.Record{
				Scope: f.scope, Key: f.key, State: idem.StateComplete, Fingerprint: "v1:hostile",
				Token: "tok-" + randToken(), CreatedAt: now, LeaseUntil: now, ExpiresAt: now.Add(longTTL), Response: resp,
			})
			if err != nil {
				return "", err
			}
			return "", tx.Commit(ctx)
		}
	}
	return m
}

// testHostileHeaders: header names and values that JSON must escape (quotes,
// backslashes, every control character, NUL), that JavaScript treats as line
// ends (U+2028, U+2029), text that looks like an escape, empty values, many
// values, non-canonical and non-ASCII names, and values large enough to leave
// a store's inline path, round-trip byte for byte through every way the store
// keeps a response — with all-UTF-8 headers and with one value that is not
// UTF-8 beside them. A complete record then refuses Complete, Release and
// Extend under its token, under the empty token and under a stale one.
func testHostileHeaders(t *testing.T, s idem.Store) {
	var ctl strings.Builder
	for c := range 0x20 {
		ctl.WriteByte(byte(c))
	}
	ctl.WriteString("\x7f")
	many := make([]string, 300)
	for i := range many {
		many[i] = fmt.Sprintf("v%d\"\\", i)
	}
	hostile := func() http.Header {
		return http.Header{
			"Content-Type":   {"text/plain; " + ctl.String(), "tab\tcr\rlf\n"},
			"Link":           {"\u2028\u2029", `"quoted" \backslash\ \u0000 \"`, strings.Repeat("€𝄞ü", 500), "</a>&<b>"},
			"X-Nul":          {"a\x00b", "\x00"},
			"X-Empty":        {"", ""},
			"X-Many":         many,
			"content-type":   {"non-canonical"},
			"X-Ünïcode":      {"ü"},
			"X-\"Quoted\\":   {"name with a quote and a backslash"},
			"X-Huge":         {strings.Repeat("h\"\\\u2028", 40<<10)}, // 240 KiB, past any inline limit
			"Location":       {"/orders/1?q=%22&x=\\u00e9"},
			"X-Json-Looking": {`{"b64":"AA=="}`, `[]`, `null`},
		}
	}
	cases := map[string]http.Header{"utf-8": hostile()}
	mixed := hostile()
	mixed["Etag"] = []string{"W/\"\xff\xfe\x80\""}
	cases["with a value not utf-8"] = mixed
	for name, complete := range completions(t, s) {
		for cname, hdr := range cases {
			t.Run(name+"/"+cname, func(t *testing.T) {
				f := newFixture(t)
				now := time.Now()
				resp := &idem.Response{Status: 201, Header: hdr, Body: []byte("{}"), Ref: "r"}
				token, err := complete(f, resp, now)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				want := &idem.Response{Status: 201, Header: hostile(), Body: []byte("{}"), Ref: "r"}
				if cname != "utf-8" {
					want.Header["Etag"] = []string{"W/\"\xff\xfe\x80\""}
				}
				checkResponse(t, mustGet(t, s, f, now).Response, want)
				for _, tok := range []string{token, "", "tok-" + randToken()} {
					wantLockLost(t, fmt.Sprintf("Complete of a complete record with token %q", tok), s.Complete(ctxFor(t), f.scope, f.key, tok, &idem.Response{Status: 500}, now, now.Add(longTTL)))
					wantLockLost(t, fmt.Sprintf("Extend of a complete record with token %q", tok), s.Extend(ctxFor(t), f.scope, f.key, tok, now, now.Add(2*longTTL)))
					wantLockLost(t, fmt.Sprintf("Release of a complete record with token %q", tok), s.Release(ctxFor(t), f.scope, f.key, tok))
				}
				rec := mustGet(t, s, f, now)
				if rec.State != idem.StateComplete {
					t.Fatalf("after the refused calls State = %v", rec.State)
				}
				checkResponse(t, rec.Response, want)
			})
		}
	}
}
