// Package redisstore is an idem.Store on Redis, through a go-redis
// redis.UniversalClient: a single node, Sentinel (failover) or Cluster.
//
//	rdb := redis.NewUniversalClient(&redis.UniversalOptions{Addrs: []string{"localhost:6379"}})
//	store, err := redisstore.New(rdb, nil)
//	if err != nil { … }
//	mw, err := idem.New(store, nil)
//
// Claim, Complete, Release and Extend are each one Lua script — one atomic step
// on the server, fenced on the claim's lock token — sent with EVALSHA (falling
// back to EVAL when the server's script cache does not have it). Get is one
// HGETALL. Any Redis with Lua scripting will do (4.0 or later, for HSET with
// several fields); Redis 7.0 is tested. Managed services that disable EVAL
// cannot be used.
//
// Use it to share idempotency keys between the instances of a service that has no
// SQL database, or whose side effects are outside any database (an e-mail, a
// payment API). When the business writes go to PostgreSQL, MySQL or SQLite, use
// that database's store instead: it commits the stored answer in the same
// transaction as the business write, which Redis cannot (see Guarantees).
//
// # Schema
//
// One Redis hash per record, under the key
//
//	<prefix>{<base64url(scope)>.<base64url(key)>}
//
// The prefix (Config.Prefix, default "idem:") may not contain braces, and unpadded
// base64url has no '.', '{' or '}', so the braces always delimit the whole
// encoded (scope, key) pair: it is the Redis Cluster hash tag, every key of one
// record hashes to one slot (today a record is a single key), records of many
// tenants spread evenly over the slots, and no tenant can choose a scope or key
// that collides with another's or moves it into another's hash tag.
//
// The hash fields (times are Unix milliseconds, in decimal):
//
//	state    "1" in flight, "2" complete
//	fp       request fingerprint ("v1:…")
//	token    lock token of the claim that holds or last held the key
//	created  when the record was first claimed
//	lease    lease deadline of the in-flight claim
//	expires  ExpiresAt (raised to the lease by Extend when the lease outruns it)
//	status   HTTP status (complete records)
//	headers  stored headers, binary: uvarint counts and lengths, names sorted
//	body     response body, raw bytes
//	omitted  "1" when the body was deliberately not stored
//	ref      resource reference recorded with idem.SetRef
//	done     random id of the Complete call that completed the record
//
// Fields whose value would be empty are not written. A record costs its body and
// headers plus roughly 200 bytes of fields and key overhead; a 1 MiB body is
// stored and replayed byte for byte (Redis bulk strings hold up to 512 MiB, but
// the middleware's MaxStoredBody, 1 MiB by default, bounds what is kept).
//
// # Time, expiry and clocks
//
// Every time the store compares (is the lease lapsed? is the record expired?)
// is the Now the middleware passes in, compared inside the script with the
// times stored in the record; no script reads Redis's clock. The Redis expiry of
// the key is set as a duration computed from the same clock: ExpiresAt − Now on
// Claim and Complete (PEXPIRE), and on Extend the longer of the key's remaining
// time to live and twice LeaseUntil − Now, so that a record whose lease is live
// is never deleted by Redis, however long its handler runs past the TTL, and a
// renewal that arrives up to one lease late, with no other request having taken
// the key over meanwhile, still finds and keeps it (as in the SQL stores, whose
// rows stay stored past the deadline). Skew
// between the application's clock and the Redis server's therefore changes
// nothing: with an application clock minutes behind Redis's, a record still lives
// its TTL (an absolute PEXPIREAT would have lain in Redis's past and deleted a
// live claim at once). Redis 7 writes the deadline to replicas and the AOF as the
// absolute instant it computed, on its own clock.
//
// Redis needs no janitor: DeleteExpired is a no-op that returns 0, nil, and
// ExpiresRecordsItself reports true. A record Redis has not yet removed but whose
// ExpiresAt is not after the caller's Now is treated as absent, as the Store
// contract requires.
//
// The lease deadline is not a Redis expiry: it is a field, compared inside the
// claim script with the Now the middleware passes in (its own clock, in ms). That
// is what the Store contract asks for (stores never read a clock of their own),
// it lets tests drive time, and within one script the comparison and the takeover
// are atomic whatever the clocks say. What clock skew between application servers
// means: a server whose clock runs d ahead sees every lease lapse d early. The
// holder renews its lease every Lease/3 (10 s of the default 30 s), so a live
// holder whose renewals get through has a deadline at least 2/3 Lease in the
// future by its own clock; skew well below that does not let it be taken over.
// Skew beyond it can let another server take over a claim whose handler is still
// running — the fenced Complete of the first holder then fails with ErrLockLost,
// but both handlers ran. Keep the servers' clocks synchronised (NTP) to well under
// Lease/3, or raise Config.Lease.
//
// # Guarantees
//
// What Redis gives:
//   - Atomic claim. The decision (absent, expired, lapsed with the same
//     fingerprint, or held) and the write are one script; Redis runs scripts one
//     at a time, so exactly one of any number of concurrent claims of a key wins.
//   - Fencing. Complete, Release and Extend compare the lock token inside their
//     script: a request whose lease lapsed and was taken over cannot complete,
//     release or extend the new holder's claim (ErrLockLost).
//   - Server-side expiry. Records vanish at their ExpiresAt without a janitor.
//
// What it cannot give:
//   - No shared transaction with the business database. The claim and the
//     completion are commits of their own; the business write happens in between,
//     elsewhere. If the process crashes after the business write committed and
//     before Complete reached Redis, or Complete fails because Redis is
//     unreachable at that moment, the key stays in flight until its lease
//     lapses, and the retry then takes it over and runs the handler again: the
//     operation happens twice unless the handler itself is idempotent (for example
//     a unique constraint on an order number derived from the key). A SQL store
//     closes this gap; Redis narrows it to a crash in that window.
//   - Durability across failover. Redis replicates asynchronously. A claim or a
//     completion acknowledged by a primary that dies before its replica received
//     it is lost when the replica is promoted (Sentinel or Cluster failover): the
//     key is absent again, and a retry executes the operation a second time. WAIT
//     does not make this safe: it only reports how many replicas acknowledged, it
//     does not roll back a write the others never saw, and a failover may still
//     promote a replica that missed it.
//   - Memory eviction. Run the Redis that holds idem records with
//     maxmemory-policy noeviction. Any evicting policy (allkeys-lru,
//     volatile-ttl, …; every idem key has a TTL, so volatile-* policies pick them
//     too) may drop an in-flight or complete record, and the next retry executes
//     the operation again. With noeviction a full Redis refuses new claims (OOM),
//     the middleware answers 503 and the handler does not run; complete records
//     still replay. Requests already running when it filled up can neither renew
//     their lease nor complete (a store error, as when Redis is unreachable at
//     completion): their keys stay in flight, and a retry once memory is free and
//     the lease has lapsed runs the operation again. Raise maxmemory with room to
//     spare, or shorten the TTL. The policy is per server, so do not share that
//     Redis with a cache that relies on eviction.
//   - Persistence. With RDB snapshots only (or none), a restart loses every
//     record written since the last snapshot, with the same effect as a failover.
//     Enable AOF (appendonly yes); appendfsync everysec loses at most about a
//     second of records on a power failure, appendfsync always none, at a cost in
//     write latency.
//
// A store outage fails closed: when Redis cannot be reached the middleware
// answers 503 (idempotency_store_unavailable) and does not run the handler.
//
// A command whose reply is lost (the connection died after the server ran it)
// is re-sent by go-redis on another connection, up to its MaxRetries: the script
// then runs twice. Each script's second run reports what the first did: a
// re-sent Claim recognises its own token and reports the claim as won, Extend is
// idempotent, and Complete recognises its own call id (the done field) and
// reports success, while any other Complete of a complete record still gets
// ErrLockLost. A re-sent Release finds the record gone and reports ErrLockLost,
// which the middleware ignores. When a stalled server (a slow command, a
// fork) outlasts the client's ReadTimeout, go-redis gives up on the command, but
// the server still runs it when it catches up: Complete then reports a store
// error although the record ends complete, and a Claim the middleware answered
// with 503 leaves the key in flight under a token nobody holds, as a crashed
// holder would: retries hear 409 until its lease lapses, then one takes it over. Under CLIENT PAUSE, the command of a
// client that went away is dropped, and the re-send is what runs.
//
// # Step records
//
// The Store is an idem.StepStore. A step record is a hash of its own,
// <record key>:step:<name> (fields s state, o owner, d derived key, t started,
// e expires, r result, and the call ids a and c), and the steps of one
// operation are listed in a sorted set, <record key>:steps, by start time.
// Both carry the record's hash tag, so that a script may touch them and the
// record on one Cluster node. Every write is one Lua script: BeginStep reads
// the request record (state "1", token = owner, expires > now) for Holder and
// decides and writes the step in the same atomic step; FinishStep and
// AbandonStep are fenced on (owner, started, live). Like Complete, each
// script recognises a re-send of its own call (go-redis re-sends a command
// whose reply was lost). A step's hash expires in Redis ExpiresAt − Now after
// it was written (raised, never lowered, when BeginStep moves the expiry
// later), the set with the latest of its steps; DeleteExpiredSteps has nothing
// to do. GetSteps reads the set and the hashes under WATCH, in one MULTI, so
// that it returns one snapshot.
//
// # Limits
//
// Keys, scopes and fingerprints are stored in full; a record's key is about 4/3
// of len(scope)+len(key) plus the prefix. Get may be served by a replica when the
// client routes reads there (ReadOnly, RouteByLatency, RouteRandomly); the
// middleware never calls Get, so this only affects tools that inspect records.
package redisstore
