package redisstore

import "github.com/redis/go-redis/v9"

// The Lua scripts. Each is one atomic step on one key (KEYS[1], the record
// hash), and touches no other key, as Redis Cluster requires. Times are Unix
// milliseconds of the middleware's clock, passed by the caller and compared
// with tonumber; they are stored as the strings the caller sent (never as Lua
// numbers, which Redis could format in exponent notation). No script reads
// Redis's clock (TIME): the Redis expiry is set as a duration (PEXPIRE), computed
// by the caller from the same clock, so that skew between the application and
// the Redis server changes nothing. State "1" is in flight, "2" complete
// (idem.State's values).
//
// Every script may run twice for one call: go-redis re-sends a command whose
// connection failed before the reply arrived (io.EOF and similar), after the
// server ran it. Claim and Extend are idempotent; Complete recognises its own
// call id; a re-run Release finds nothing and answers 0 (the middleware
// ignores ErrLockLost from Release).
//
// Go-redis's Script.Run sends EVALSHA and falls back to EVAL on NOSCRIPT, which
// also loads the script into the server's cache (on every Cluster node the
// first time it is routed there).
var (
	// claimScript: ARGV = fingerprint, token, now, leaseUntil, expiresAt, ttl
	// (expiresAt − now in ms, at least 1). Reply: the created time (a string)
	// when claimed; the existing record's HGETALL (an array) when not.
	claimScript = redis.NewScript(`
local k = KEYS[1]
local now = tonumber(ARGV[3])
local cur = redis.call('HMGET', k, 'state', 'fp', 'token', 'created', 'lease', 'expires')
local created = ARGV[3]
if cur[1] then
  if tonumber(cur[6]) > now then
    if cur[1] == '1' and cur[3] == ARGV[2] then
      -- This very claim already succeeded: the command is a client retry whose
      -- first reply was lost. Tokens are fresh per claim, so it is ours.
      return cur[4]
    end
    if cur[1] ~= '1' or tonumber(cur[5]) > now or cur[2] ~= ARGV[1] then
      return redis.call('HGETALL', k)
    end
    -- In flight, lease lapsed, same fingerprint: take over, keeping created.
    created = cur[4]
  end
  -- Expired (and not yet removed by Redis), or taken over: replace it whole.
  redis.call('DEL', k)
end
redis.call('HSET', k, 'state', '1', 'fp', ARGV[1], 'token', ARGV[2], 'created', created, 'lease', ARGV[4], 'expires', ARGV[5])
redis.call('PEXPIRE', k, ARGV[6])
return created
`)

	// completeScript: ARGV = token, expiresAt, ttl (expiresAt − now in ms, at
	// least 1), call (a random id of this Complete call), then field/value pairs
	// of the response (empty values are not stored). Reply: 1 done, 0 lock lost.
	// A re-run of the same call (go-redis re-sends a command whose reply was
	// lost) finds its own call id on the completed record and answers 1 again;
	// any other call on a complete record gets 0.
	completeScript = redis.NewScript(`
local k = KEYS[1]
local cur = redis.call('HMGET', k, 'state', 'token', 'done')
if cur[2] ~= ARGV[1] then
  return 0
end
if cur[1] == '2' and cur[3] == ARGV[4] then
  return 1
end
if cur[1] ~= '1' then
  return 0
end
local set = {'state', '2', 'expires', ARGV[2], 'done', ARGV[4]}
for i = 5, #ARGV - 1, 2 do
  if ARGV[i + 1] ~= '' then
    set[#set + 1] = ARGV[i]
    set[#set + 1] = ARGV[i + 1]
  end
end
redis.call('HSET', k, unpack(set))
redis.call('PEXPIRE', k, ARGV[3])
return 1
`)

	// releaseScript: ARGV = token. Reply: 1 deleted, 0 lock lost.
	releaseScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'state', 'token')
if cur[1] ~= '1' or cur[2] ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
return 1
`)

	// extendScript: ARGV = token, leaseUntil, keep (2 × (leaseUntil − now) in
	// ms, at least 1). It moves the lease, raises the expires field to
	// leaseUntil when it is earlier, and raises the key's Redis TTL to keep when
	// it is shorter (never lowering it): a record whose lease is live never
	// expires, and a late renewal finds the record for one more lease.
	// Reply: 1 extended, 0 lock lost.
	extendScript = redis.NewScript(`
local k = KEYS[1]
local cur = redis.call('HMGET', k, 'state', 'token', 'expires')
if cur[1] ~= '1' or cur[2] ~= ARGV[1] then
  return 0
end
if tonumber(cur[3]) < tonumber(ARGV[2]) then
  redis.call('HSET', k, 'lease', ARGV[2], 'expires', ARGV[2])
else
  redis.call('HSET', k, 'lease', ARGV[2])
end
local ttl = redis.call('PTTL', k)
if ttl >= 0 and ttl < tonumber(ARGV[3]) then
  redis.call('PEXPIRE', k, ARGV[3])
end
return 1
`)
)
