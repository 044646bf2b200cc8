// Package checker checks whether an HTTP endpoint handles the Idempotency-Key
// header as docs/design.md §1 and the IETF draft (draft-ietf-httpapi-idempotency-key-header)
// say. It talks HTTP only, so it checks any API in any language, whether it uses
// idem or not. It is the logic of `idem check`; tests drive it directly:
//
//	rep, err := checker.Run(ctx, checker.Options{URL: "http://127.0.0.1:8080/orders"})
//	if err != nil { … }          // bad options (ErrInvalidOptions) or ctx ended
//	rep.WriteTable(os.Stdout)
//	if rep.Failed() { … }
//
// # Cases
//
// Run executes these cases in order; each ends pass, warn, fail or skip. Only a
// fail makes the report fail.
//
//   - first_request: a request with a fresh key succeeds (2xx).
//   - replay: the identical retry with the same key gets the same status, a
//     byte-identical body and the same Location; a missing
//     "Idempotent-Replayed: true" is a warning.
//   - changed_body: a different body with the used key gets 422 (400, 409 or
//     another 4xx is a warning; a replay of the first answer or an execution fails).
//   - new_key: the first request's body with a new key is a new operation: a
//     different body or Location, or a count of 2 — not a cached answer. Two
//     identical answers (a 204, say) are two executions when the server marks
//     its replays and marked neither (the checker asks once when no answer has
//     shown whether it marks them).
//   - missing_key: no key gets 400 (skipped with KeyOptional).
//   - long_key: two 256-character keys that differ only in the last character.
//     400 passes; acceptance is a warning (the limit is configurable), but the
//     second key getting a replay, a 422 or a 409 fails (the server cuts keys
//     short and merges operations); a 5xx fails.
//   - hangup: a request with a fresh key is hung up on (its connection
//     closed) HangupAfter after it was sent — by default half the shortest
//     execution seen, halved again up to three times when the answer still
//     comes first; skipped when executions take less than HangupMinWait. Just
//     before, a second request with the key shows whether it is in flight
//     (409). Then the same key and body are retried until the answer is not
//     409: it must be the replay of the one execution (2xx), and with a count
//     URL one resource must exist. A fresh, unmarked execution from a server
//     that marks replays fails when the request was seen in flight (the
//     hang-up undid it: a transaction bound to the request context), and is a
//     warning otherwise; without marks or a count it is a warning.
//   - race: Concurrency identical requests with one fresh key, each on its own
//     connection dialled beforehand, released together from a barrier and each
//     sent exactly once. At most one may execute: every 2xx body is identical,
//     at most one 2xx answer lacks Idempotent-Replayed when the server marks
//     replays, and every other answer is 409 (429 is a warning: the race was
//     smaller). With a count URL, exactly one resource must exist. Rounds repeats
//     it with fresh keys.
//   - tenant_isolation: tenant B (TenantBHeader) sending tenant A's key and body
//     must get its own execution or an error, never tenant A's answer (a replay,
//     or the same bytes unless the server marks replays and marked neither). A
//     409 or 422 is a warning: the tenants share a key namespace.
//
// An answer is a replay when its Idempotent-Replayed header is "true" in any
// letter case, as client.Replayed decides: the header is Stripe's convention,
// not an RFC 9651 structured field, so "?1" does not count. The other spellings
// servers use (Idempotency-Replayed, X-Idempotent-Replayed, …: OtherReplayMarks)
// set to "true" count as a replay mark too, and the replay case then warns that
// clients look for Idempotent-Replayed, so that the warning is about the
// spelling, not about a missing mark.
//
// Error answers (400, 422) that are not application/problem+json (RFC 9457) are
// warnings.
//
// # Body template and markers
//
// The body is a template. "{{marker}}" becomes a marker unique to each case of a
// run ("chk<10 hex>-first", "-changed", "-race1", …), so that the resources one
// case creates can be counted on a shared server; "{{n}}" becomes a number unique
// to each operation of a run. Retries of one operation send the same bytes; the
// new_key case deliberately re-sends the first request's bytes.
//
// # Counting on the server
//
// Answers alone cannot prove a single execution when the server does not name the
// resource it created. With CountURL, a GET URL template such as
// http://h/orders?cart_id={{marker}} sent with Header, the checker counts what
// exists: 1 after first_request and replay, 2 after new_key, 1 after each race
// round. The count is the length of the first JSON array in the answer, or, with
// CountPath, the array or number at a dotted path of members and indexes such as
// "orders" or "data.0.total".
//
// # Limits
//
// Every request uses a fresh connection without keep-alives, so Go's Transport
// never re-sends one (docs/design.md §6); redirects are not followed and proxy
// settings from the environment are not used. HTTP/1.1 only. Answers are read up
// to 4 MiB. The race cannot prove the absence of a race — it makes one likely:
// raise Rounds for more confidence, and count on the server.
package checker
