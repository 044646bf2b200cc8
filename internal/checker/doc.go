// Package checker checks whether an HTTP endpoint handles the Idempotency-Key
// header as DESIGN.md §1 and the IETF draft (draft-ietf-httpapi-idempotency-key-header)
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
//     different body or Location, or a count of 2 — not a cached answer.
//   - missing_key: no key gets 400 (skipped with KeyOptional).
//   - long_key: a 256-character key gets 400 (acceptance is a warning, since the
//     limit is configurable; a 5xx fails).
//   - race: Concurrency identical requests with one fresh key, each on its own
//     connection dialled beforehand, released together from a barrier and each
//     sent exactly once. At most one may execute: every 2xx body is identical,
//     at most one 2xx answer lacks Idempotent-Replayed when the server marks
//     replays, and every other answer is 409 (429 is a warning: the race was
//     smaller). With a count URL, exactly one resource must exist. Rounds repeats
//     it with fresh keys.
//   - tenant_isolation: tenant B (TenantBHeader) sending tenant A's key and body
//     must get its own execution or an error, never tenant A's answer. A 409 or
//     422 is a warning: the tenants share a key namespace.
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
// never re-sends one (DESIGN.md §6); redirects are not followed and proxy
// settings from the environment are not used. HTTP/1.1 only. Answers are read up
// to 4 MiB. The race cannot prove the absence of a race — it makes one likely:
// raise Rounds for more confidence, and count on the server.
package checker
