// Package idem makes retried writes safe: net/http middleware that executes each
// operation named by an Idempotency-Key header once, and answers every retry of it
// with the outcome of that one execution.
//
// A record is identified by (scope, key), where the scope is the tenant or
// principal (see WithScope). It is absent, in flight or complete:
//
//   - absent or expired: the request claims the key atomically, the handler runs
//     once, and its response (status, allow-listed headers, body — 4xx and 5xx
//     included) is stored;
//   - in flight with a live lease: 409 with Retry-After (idempotency_key_in_use);
//   - in flight with a lapsed lease (the holder crashed): taken over with a new
//     lock token, the handler runs;
//   - complete: the stored response is replayed byte for byte with
//     Idempotent-Replayed: true;
//   - in flight or complete with a different request fingerprint: 422
//     (idempotency_key_reused).
//
// The state machine of one record, as the middleware drives it:
//
//	               claim (atomic)                    complete (fenced by token)
//	absent ───────────────────────────▶ in flight ───────────────────────────▶ complete
//	  ▲  ▲                              │  ▲   │                                   │
//	  │  └──── release (panic, unkept  ─┘  │   │ lease lapsed: takeover            │
//	  │        outcome, failed commit)     └───┘ under a new token                 │
//	  └──────────────────────────── expired (TTL; never while a lease is live) ◀───┘
//
// A handler that runs longer than the TTL keeps its key: lease renewal raises
// the record's expiry. Once claimed, the operation runs to its end whatever the
// client does: the handler's context keeps the request's values but not the
// client's cancellation, and ends only at Config.HandlerTimeout or when the
// lease is lost (context.Cause is then ErrLockLost). The full contract, the two
// flows and their limits are in docs/design.md in the repository.
//
// Malformed or missing keys get 400, bodies over the limit 413, and a store that
// cannot be reached 503 — the handler never runs then. Every error answer is an
// RFC 9457 problem (application/problem+json) with a stable "code" member.
//
// # Stores
//
// The core depends on the standard library only. Records live in a Store:
// memstore (in memory), sqlitestore, pgstore, mysqlstore and redisstore. The SQL
// stores implement TxStore: the middleware opens a database transaction before the
// handler, the handler does its business writes in it, and the completion commits
// in the same transaction — the order and the stored answer both exist, or neither
// does. Leases are fenced: a request whose lease was taken over cannot complete.
//
// # Keeping outcomes
//
// By default the full response is stored and replayed. With Config.ReplayFunc the
// body is not stored: the handler records a resource reference with SetRef (or
// nothing, for a marker), and ReplayFunc rebuilds the answer on every retry.
//
// # Calls to other services
//
// A call to another service (a payment provider, a carrier) is outside the
// store's transaction. Make it a step with Step: its outcome is recorded before
// Step returns, so that a retry or a takeover gets it without calling again,
// and the call sends the step's derived key as its Idempotency-Key, so that a
// crash during the call is harmless with a service that honours the header.
// docs/effects.md in the repository says what each kind of effect needs and
// which windows remain.
package idem
