package redisstore

import "github.com/redis/go-redis/v9"

// The Lua scripts. Each is one atomic step on one key (KEYS[1], the record
// hash). Times are Unix milliseconds, passed by the caller and compared with
// tonumber; they are stored as the strings the caller sent (never as Lua
// numbers, which Redis could format in exponent notation). State "1" is in
// flight, "2" complete (idem.State's values).
//
// Go-redis's Script.Run sends EVALSHA and falls back to EVAL on NOSCRIPT, which
// also loads the script into the server's cache (on every Cluster node the
// first time it is routed there).
var (
	// claimScript: ARGV = fingerprint, token, now, leaseUntil, expiresAt.
	// Reply: the created time (a string) when claimed; the existing record's
	// HGETALL (an array) when not.
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
redis.call('PEXPIREAT', k, ARGV[5])
return created
`)

	// completeScript: ARGV = token, expiresAt, then field/value pairs of the
	// response (empty values are not stored). Reply: 1 done, 0 lock lost.
	completeScript = redis.NewScript(`
local k = KEYS[1]
local cur = redis.call('HMGET', k, 'state', 'token')
if cur[1] ~= '1' or cur[2] ~= ARGV[1] then
  return 0
end
local set = {'state', '2', 'expires', ARGV[2]}
for i = 3, #ARGV - 1, 2 do
  if ARGV[i + 1] ~= '' then
    set[#set + 1] = ARGV[i]
    set[#set + 1] = ARGV[i + 1]
  end
end
redis.call('HSET', k, unpack(set))
redis.call('PEXPIREAT', k, ARGV[2])
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

	// extendScript: ARGV = token, leaseUntil. Reply: 1 extended, 0 lock lost.
	extendScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 'state', 'token')
if cur[1] ~= '1' or cur[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'lease', ARGV[2])
return 1
`)
)
