// Package bench is the harness behind `idem bench`: it measures what idem costs
// on each store, against the same handler without idem, and against Fiber v2's
// idempotency middleware.
//
// # What runs
//
// For each store (memory, sqlite, postgres, mysql, redis) Run starts an HTTP
// server on 127.0.0.1 with one orders handler mounted several ways:
//
//	POST /bare/orders    the handler alone (the baseline)
//	POST /idem/orders    idem in front of it, with the store's default flow
//	POST /single/orders  idem with Flow = FlowSingleTx (SQL stores)
//	POST /claim/orders   idem with Flow = FlowClaimComplete (PostgreSQL)
//	POST /hand/orders    the hand-written reference (PostgreSQL: handOrders; MariaDB with multiStatements: handMySQL)
//
// With Config.Isolate the server runs in a process of its own (Serve, started
// as Config.ServerCommand and, with Config.Pin, pinned to CPU 0 with taskset),
// and the load generator in the calling process, pinned to CPU 1. Before and
// after every slice the harness reads the server's counters (GET
// /_bench/stats): orders stored, the server process's CPU time (getrusage),
// heap allocations, the round trips and statements on its database connections
// (counted by a wrapping net.Conn that parses the client side of the wire
// protocol), and the database's CPU time (/proc of the PostgreSQL backends of
// the measured pool, or of the whole MariaDB or Redis process). Differences
// divided by the answers of the slice give the per-request figures. A memory
// phase (Config.MemoryRecords) then sends first-time requests to fresh memstore
// and Fiber servers and reads their peak RSS.
//
// The handler decodes {"item": "widget", "qty": 1}, inserts one order row and
// answers 201 with the order as JSON and a Location header. For the SQL stores
// the row goes into an orders table in the same database as the idempotency
// records, inside idem's transaction (sqlitestore.Tx, pgstore.Tx, mysqlstore.Conn)
// when there is one; for memory and redis, and for Fiber, into an in-process map.
//
// The variants, each a cell per number of clients:
//
//   - baseline: /bare/orders without a key;
//   - first: a fresh key per request, so every request claims, executes and completes;
//   - replay: cycling through Config.ReplayKeys keys completed before the cells, so
//     every answer is a replay;
//   - hot key: all clients send the same key, a new one every HotKeyEvery
//     requests: one execution per key, the rest 409s (while it is in flight) and
//     replays;
//   - single-tx first, claim-complete first, hand-written first: the explicit
//     flows and the hand-written reference, with fresh keys.
//
// # Load
//
// The load generator is a closed loop of its own (net/http clients): N
// goroutines, each one client that sends its next request when the previous one
// was answered, over kept-alive loopback connections. N is therefore the number
// of requests in flight, which is what "N concurrent clients" means; an
// open-loop (fixed-rate) generator would measure queueing at a chosen rate
// instead. Throughput is answers per second; latency is measured per request by
// the client, p50 and p99 by nearest rank over all requests of a cell.
//
// The machine is shared and noisy, so the result is the ratio to the baseline
// measured in the same run, not absolute numbers: each cell's Duration is split
// into Rounds slices, and round r runs every variant once, in an order rotated by
// r, so that drift hits baseline and variants alike.
//
// # Honesty checks
//
// Before and after every slice the harness counts the rows in the orders table,
// and it counts answers by status and by the Idempotent-Replayed header. A cell
// fails its check (Result.Check, and `idem bench` exits 1) when the rows do not
// equal the executed requests, when a replay executed the handler, when fresh
// keys were answered 409 or replayed, when a hot key executed more than once, or
// when any answer was an error. Fiber does not mark replays; for it a 2xx answer
// that inserted no row counts as a replay.
//
// # Growth
//
// With Config.Growth, runGrowth bulk-loads complete records into a dedicated
// pgstore table up to each of GrowthSizes, and times store.Claim on fresh keys at
// each size, alternating every claim with one on a reference table that keeps the
// smallest size, so that both are timed in the same window. The loader sends
// records generated in Go (UUID keys spread over the key space, as in
// production) with COPY, GrowthChunk records (default 1 000 000) per transaction sorted by key (each
// chunk walks the primary key's leaves once instead of missing shared_buffers
// on every record; the leaves split where the keys fall, as with random
// inserts), on GrowthConns connections (default 2) whose sessions
// set synchronous_commit=off and, where allowed, wal_compression=on; the table
// stays logged, with the server's autovacuum setting and the per-table settings docs/operating.md
// recommends (Autovacuum). Each step records the heap, each index and the total
// size. With GrowthBudget, a size whose projected load would not end in time is
// not loaded, and the report's note says so.
//
// The first JanitorBacklog records loaded expired during the hour before the
// run (the oldest records, as in a table whose janitor stopped for a while).
// After the steps, claims are timed while idem.Janitor{BatchSize: 1000}.Sweep
// deletes them; then n_dead_tup is read, the table is vacuumed, and the heap's
// free and dead space is measured with pgstattuple_approx (the extension is
// created when available, and dropped again if the run created it). Last, fresh
// records are loaded (as many as were deleted, at most 1 000 000) to show how
// much of the freed space they reuse.
//
// # Tables and cleanup
//
// Every run uses names with a random suffix and removes them at the end:
// idem_bench_<suffix> and orders_bench_<suffix> (PostgreSQL, MySQL, and the
// SQLite file in a temporary directory), idem_bench_<suffix>_migrations (MySQL),
// the Redis key prefix idembench_<suffix>:, and idem_growth_<suffix> and
// idem_growth_ref_<suffix> (with their _steps tables) for the growth run. A run killed with SIGKILL leaves
// them behind; Redis records expire after an hour (the TTL the harness sets).
//
// # Limits
//
// Without Config.Isolate, load generator and server share one process and the
// machine's CPUs, so the generator's own cost is part of every number and CPU
// per request is not measured. With it, the databases still share the two CPUs
// with both processes. Commit latency (fsync) dominates the SQL numbers at one
// client.
package bench
