// Package orders is the reference checkout service of the idem articles, served
// by `idem demo`: a tiny orders API whose one write endpoint is made idempotent by
// the idem middleware.
//
// # API
//
//	POST /orders        {"cart_id": "c_42", "total_cents": 1900}
//	                    → 201, Location: /orders/{id},
//	                      {"id": "ord_…", "cart_id": "c_42", "total_cents": 1900, "created_at": "…"}
//	                      (and "charge_id": "ch_…" with Config.Payments)
//	GET  /orders/{id}   → 200 the order, or 404 (also for another tenant's order,
//	                      and for anything that is not an order id)
//	GET  /orders        → 200 {"orders": […], "next": "/orders?after=…&limit=…"} of the
//	                      caller's tenant, oldest first; ?cart_id= filters, ?limit=
//	                      (1–1000, default 100) sizes the page, ?after=ID continues
//	                      after that order; "next" (and a Link rel="next" header) is
//	                      there only when more orders follow
//	GET  /healthz       → 200 {"status":"ok"} when the database answers, else 503
//
// What the service stores or compares with stored text is checked first, the
// same on every database: a cart_id is 1–255 bytes of UTF-8 without control
// characters or leading/trailing white space (MySQL's utf8mb4_bin ignores
// trailing spaces in comparisons); a tenant likewise, and Authenticate accepts
// only RFC 6750 bearer tokens (letters, digits, -._~+/ and = padding) of at most
// 255 bytes. A bad query parameter is a 400 "invalid_query"; a bad token a 401.
// Answers and messages repeat at most 64 bytes of a client's value (Quote).
//
// Invalid JSON, unknown fields, a missing or empty cart_id, or a total_cents that
// is missing, negative or not a whole number get 400 application/problem+json
// (code "invalid_order"). The HANDLER writes that answer, behind idem, so it is
// stored and replayed like any other outcome: a retry of a bad request gets the
// same 400 without running again. Other codes: "order_not_found" (404),
// "invalid_query" (400), "unauthorized" (401, from Authenticate, in front of idem,
// never bound to a key),
// "order_not_saved" (500), "request_cancelled" (503), "database_unavailable" and
// "database_error". Each problem's type is idem.ProblemTypeBase + code.
//
// # Transactions
//
// The order is inserted in the transaction the idem store opened for the request
// (sqlitestore.Tx, pgstore.Tx, mysqlstore.Tx, passed to SQL or Pgx as txFunc), so
// the order and the stored answer commit together or not at all. Without a store
// transaction (keys in Redis) the handler commits its own transaction, and the
// guarantee is weaker: a crash between that commit and the completion in Redis
// leaves an order whose key is released when its lease lapses, and a retry then
// creates a second order.
//
// Config.OnCreate is called in that transaction after the insert, with the
// transaction (Tx): the demo enqueues the order's event into its outbox there,
// so the event commits with the order or not at all.
//
// Config.HandlerDelay sleeps inside the transaction after the insert, to widen the
// race window in demonstrations.
//
// # Payments
//
// With Config.Payments every new order is first charged at a payment provider
// (see Payments) as the step "charge" of the request's operation (idem.Step):
// the call's Idempotency-Key is the step's derived key, the same for every
// attempt of one order, and the charge's id is recorded before the order is
// inserted, so a retry after a crash takes the recorded charge without a
// second call. A decline (a 4xx other than 408, 409, 425, 429) is a final,
// recorded failure: 402 "payment_failed", stored and replayed. A provider
// that fails, does not answer or answers too late is a transient failure:
// 502 "payment_unavailable", not stored (with idem demo's 5xx policy), and the
// retry asks again with the same key. With Payments.RefuseUnknown a charge
// begun and never recorded, or sent and unanswered, is not run again: 502
// "payment_unknown", the request's outcome unknown until an operator settles
// the step (idem resolve --step charge).
//
// # Schema
//
// One table (default name "orders") next to the key records, created by Migrate:
//
//	id          TEXT PRIMARY KEY      -- "ord_" + 24 hex digits, made by the service
//	tenant      TEXT NOT NULL         -- the idem scope (the bearer token in the demo)
//	cart_id     TEXT NOT NULL         -- at most 255 bytes
//	total_cents BIGINT NOT NULL       -- >= 0
//	created_at  TIMESTAMPTZ NOT NULL  -- DATETIME(6) in MySQL, fixed-width UTC text in SQLite
//	charge_id   TEXT                  -- the provider's charge id; NULL without Config.Payments
//	INDEX (tenant, cart_id, created_at)
//
// # Limits
//
// GET /orders returns at most MaxPageSize orders per page. The tenant is trusted as given:
// Authenticate is demo-only and verifies nothing.
package orders
