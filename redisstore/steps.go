package redisstore

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
)

var _ idem.StepStore = (*Store)(nil)

// stepKey returns the Redis key of the hash that holds step name's record of
// (scope, key): the record's key, ":step:" and the name; stepsKey the key of
// the sorted set that lists the operation's steps (by StartedAt): the
// record's key and ":steps". Both have the record's hash tag (the first
// braces), so that one script may touch them and the record on Redis
// Cluster, and neither equals a record's key (those have no ':' after the
// prefix) or the other.
func (s *Store) stepKey(scope, key, name string) string {
	return s.recordKey(scope, key) + ":step:" + name
}

func (s *Store) stepsKey(scope, key string) string {
	return s.recordKey(scope, key) + ":steps"
}

// The fields of a step record's hash.
const (
	sfState   = "s" // "1" started, "2" done, "3" failed
	sfOwner   = "o" // "" once abandoned
	sfDerived = "d"
	sfStarted = "t" // Unix ms
	sfExpires = "e" // Unix ms
	sfResult  = "r" // absent while started
	// sfFingerprint is the fingerprint of the request that wrote the record;
	// absent in a record written without one (by a consumer, or before step
	// records carried it).
	sfFingerprint = "f"
	// "a" holds the call id of the BeginStep that last began the step, "c"
	// that of the last FinishStep or AbandonStep (see the scripts).
)

var (
	// beginStepScript: KEYS = step hash, steps index, request record. ARGV =
	// name, owner, derived key, now, expiresAt, ttl (expiresAt − now in ms, at
	// least 1), holder ("1" or ""), rerun ("1" or ""), call id, fingerprint,
	// first ("1" or ""). Reply: {0} when the Holder fence failed; else {began,
	// state, owner, derived key, started, expires, result, fingerprint}, and
	// with first, when a live record of the operation (any step the index
	// lists, its hash beside the step's, under the same hash tag) has another
	// request's fingerprint, that record's fields and its name, nothing
	// written. A live record of
	// another request (both fingerprints set, and different) is left as it
	// is, its expiry too. The fence reads the request record as
	// claimScript wrote it (state "1", token, expires), in the same atomic
	// step. A re-run of the same call (go-redis re-sends a command whose reply
	// was lost) finds its own call id and answers began again. The step's
	// hash expires in Redis with the step (its Redis TTL raised to ttl when
	// the expiry moves later, never lowered), the index with the latest step.
	beginStepScript = redis.NewScript(`
local h, idx = KEYS[1], KEYS[2]
local now = tonumber(ARGV[4])
if ARGV[7] == '1' then
  local r = redis.call('HMGET', KEYS[3], 'state', 'token', 'expires')
  if r[1] ~= '1' or r[2] ~= ARGV[2] or not r[3] or tonumber(r[3]) <= now then
    return {0}
  end
end
if ARGV[11] == '1' and ARGV[10] ~= '' then
  local prefix = string.sub(h, 1, #h - #ARGV[1])
  for _, n in ipairs(redis.call('ZRANGE', idx, 0, -1)) do
    local o = redis.call('HMGET', prefix .. n, 'e', 'f')
    if o[1] and tonumber(o[1]) > now and o[2] and o[2] ~= '' and o[2] ~= ARGV[10] then
      local rec = redis.call('HMGET', prefix .. n, 's', 'o', 'd', 't', 'e', 'r', 'f')
      return {0, rec[1], rec[2], rec[3], rec[4], rec[5], rec[6], rec[7], n}
    end
  end
end
local cur = redis.call('HMGET', h, 's', 'o', 'e', 'a', 'f')
local began = 0
local raise = false
if not cur[1] or tonumber(cur[3]) <= now then
  redis.call('DEL', h)
  redis.call('HSET', h, 's', '1', 'o', ARGV[2], 'd', ARGV[3], 't', ARGV[4], 'e', ARGV[5], 'a', ARGV[9])
  if ARGV[10] ~= '' then
    redis.call('HSET', h, 'f', ARGV[10])
  end
  redis.call('ZADD', idx, ARGV[4], ARGV[1])
  began = 1
  raise = true
elseif cur[5] and cur[5] ~= '' and ARGV[10] ~= '' and cur[5] ~= ARGV[10] then
  -- another request's record: left as it is
else
  if cur[1] == '1' and cur[4] == ARGV[9] and cur[2] == ARGV[2] then
    began = 1
  elseif cur[1] == '1' and (cur[2] == '' or (ARGV[8] == '1' and cur[2] ~= ARGV[2])) then
    redis.call('HSET', h, 'o', ARGV[2], 'a', ARGV[9])
    began = 1
  end
  if tonumber(cur[3]) < tonumber(ARGV[5]) then
    redis.call('HSET', h, 'e', ARGV[5])
    raise = true
  end
end
if raise then
  for _, k in ipairs({h, idx}) do
    local ttl = redis.call('PTTL', k)
    if ttl < tonumber(ARGV[6]) then
      redis.call('PEXPIRE', k, ARGV[6])
    end
  end
end
local rec = redis.call('HMGET', h, 's', 'o', 'd', 't', 'e', 'r', 'f')
return {began, rec[1], rec[2], rec[3], rec[4], rec[5], rec[6], rec[7]}
`)

	// endStepScript: KEYS = step hash. ARGV = owner, now, call id, then the
	// field/value pairs to set. Reply: 1 done, 0 lock lost (no live started
	// record of owner). A re-run of the same call finds its call id and
	// answers 1.
	endStepScript = redis.NewScript(`
local h = KEYS[1]
local cur = redis.call('HMGET', h, 's', 'o', 'e', 'c')
if cur[4] == ARGV[3] then
  return 1
end
if cur[1] ~= '1' or ARGV[1] == '' or cur[2] ~= ARGV[1] or tonumber(cur[3]) <= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', h, 'c', ARGV[3], unpack(ARGV, 4))
return 1
`)

	// settleStepScript: KEYS = step hash, steps index. ARGV = name, state ("0"
	// forgets the record), result, now. Reply: 1 done, 0 no live record.
	settleStepScript = redis.NewScript(`
local cur = redis.call('HMGET', KEYS[1], 's', 'e')
if not cur[1] or tonumber(cur[2]) <= tonumber(ARGV[4]) then
  return 0
end
if ARGV[2] == '0' then
  redis.call('DEL', KEYS[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  redis.call('HSET', KEYS[1], 's', ARGV[2], 'r', ARGV[3])
end
return 1
`)
)

// checkStep refuses what no caller may pass: empty or overlong names, NUL
// bytes in names and owners.
func checkStep(name, owner string) error {
	if name == "" {
		return errors.New("redisstore: the step name is empty; name every step")
	}
	if err := idem.CheckFieldSize("redisstore", "step name", int64(len(name)), idem.MaxStepNameLength); err != nil {
		return err
	}
	if err := idem.CheckFieldSize("redisstore", "step owner", int64(len(owner)), maxStepText); err != nil {
		return err
	}
	if strings.IndexByte(name, 0) >= 0 || strings.IndexByte(owner, 0) >= 0 {
		return errors.New("redisstore: a step name or owner contains a NUL byte; use visible ASCII")
	}
	return nil
}

// maxWatchRounds bounds GetSteps' optimistic reads of a busy operation.
const maxWatchRounds = 100

// maxStepText bounds an owner token and a derived key.
const maxStepText = 1024

func flag(b bool) string {
	if b {
		return "1"
	}
	return ""
}

// BeginStep implements idem.StepStore with one Lua script (one round trip)
// that checks the request record (with req.Holder) and decides and writes
// the step record atomically.
func (s *Store) BeginStep(ctx context.Context, req idem.BeginStepRequest) (*idem.StepRecord, bool, error) {
	if err := checkStep(req.Name, req.Owner); err != nil {
		return nil, false, err
	}
	if req.DerivedKey == "" || strings.IndexByte(req.DerivedKey, 0) >= 0 {
		return nil, false, errors.New("redisstore: begin step: the derived key is empty or contains a NUL byte")
	}
	if err := idem.CheckFieldSize("redisstore", "step derived key", int64(len(req.DerivedKey)), maxStepText); err != nil {
		return nil, false, err
	}
	res, err := beginStepScript.Run(ctx, s.client, []string{s.stepKey(req.Scope, req.Key, req.Name), s.stepsKey(req.Scope, req.Key), s.recordKey(req.Scope, req.Key)},
		req.Name, req.Owner, req.DerivedKey, ms(req.Now), ms(req.ExpiresAt), ttl(req.Now, req.ExpiresAt),
		flag(req.Holder), flag(req.Rerun), callID(), req.Fingerprint, flag(req.First)).Slice()
	if err != nil {
		return nil, false, storeErr("begin step", err)
	}
	if len(res) == 1 {
		return nil, false, idem.ErrLockLost
	}
	name := req.Name
	if len(res) == 9 {
		name, _ = res[8].(string) // another request's record of the operation
	} else if len(res) != 8 {
		return nil, false, fmt.Errorf("redisstore: begin step: unexpected reply of %d values", len(res))
	}
	began, _ := res[0].(int64)
	f := map[string]string{}
	for i, name := range []string{sfState, sfOwner, sfDerived, sfStarted, sfExpires, sfResult, sfFingerprint} {
		if v, ok := res[i+1].(string); ok {
			f[name] = v
		}
	}
	rec, err := decodeStep(req.Scope, req.Key, name, f)
	if err != nil {
		return nil, false, err
	}
	if rec.StartedAt.Equal(msTime(req.Now)) {
		rec.StartedAt = req.Now
	}
	if rec.ExpiresAt.Equal(msTime(req.ExpiresAt)) {
		rec.ExpiresAt = req.ExpiresAt
	}
	return rec, began == 1, nil
}

// decodeStep reads step name's record from the fields of its hash.
func decodeStep(scope, key, name string, f map[string]string) (*idem.StepRecord, error) {
	state, err := strconv.Atoi(f[sfState])
	if err != nil || state < int(idem.StepStarted) || state > int(idem.StepFailed) {
		return nil, fmt.Errorf("redisstore: step %q of a record: malformed state %q; the hash was changed outside idem", name, f[sfState])
	}
	started, err1 := strconv.ParseInt(f[sfStarted], 10, 64)
	expires, err2 := strconv.ParseInt(f[sfExpires], 10, 64)
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("redisstore: step %q of a record: malformed times; the hash was changed outside idem", name)
	}
	rec := &idem.StepRecord{Scope: scope, Key: key, Name: name, State: idem.StepState(state),
		Owner: f[sfOwner], DerivedKey: f[sfDerived], Fingerprint: f[sfFingerprint],
		StartedAt: time.UnixMilli(started), ExpiresAt: time.UnixMilli(expires)}
	if r, ok := f[sfResult]; ok && rec.State != idem.StepStarted {
		rec.Result = []byte(r)
	}
	return rec, nil
}

// FinishStep implements idem.StepStore: one fenced Lua script.
func (s *Store) FinishStep(ctx context.Context, scope, key, name, owner string, state idem.StepState, result []byte, now time.Time) error {
	if err := checkStep(name, owner); err != nil {
		return err
	}
	if state != idem.StepDone && state != idem.StepFailed {
		return fmt.Errorf("redisstore: finish step: state %v; a step finishes done or failed", state)
	}
	if err := idem.CheckFieldSize("redisstore", "step result", int64(len(result)), maxBulk); err != nil {
		return err
	}
	n, err := endStepScript.Run(ctx, s.client, []string{s.stepKey(scope, key, name)},
		owner, ms(now), callID(), sfState, strconv.Itoa(int(state)), sfResult, result).Int()
	return fenced("finish step", n, err)
}

// AbandonStep implements idem.StepStore: one fenced Lua script.
func (s *Store) AbandonStep(ctx context.Context, scope, key, name, owner string, now time.Time) error {
	if err := checkStep(name, owner); err != nil {
		return err
	}
	n, err := endStepScript.Run(ctx, s.client, []string{s.stepKey(scope, key, name)},
		owner, ms(now), callID(), sfOwner, "").Int()
	return fenced("abandon step", n, err)
}

// GetSteps implements idem.StepStore: under WATCH of the index, the index
// (ZRANGE), then every step's hash in one MULTI/EXEC, so that the names and
// the records are one snapshot (a step begun in between makes EXEC fail, and
// GetSteps reads again). A step whose hash Redis deleted (expired) is left
// out.
func (s *Store) GetSteps(ctx context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	idx := s.stepsKey(scope, key)
	var names []string
	var cmds []*redis.MapStringStringCmd
	read := func(tx *redis.Tx) error {
		var err error
		if names, err = tx.ZRange(ctx, idx, 0, -1).Result(); err != nil || len(names) == 0 {
			return err
		}
		cmds = make([]*redis.MapStringStringCmd, len(names))
		_, err = tx.TxPipelined(ctx, func(p redis.Pipeliner) error {
			for i, name := range names {
				cmds[i] = p.HGetAll(ctx, s.stepKey(scope, key, name))
			}
			return nil
		})
		return err
	}
	var err error
	for range maxWatchRounds {
		names, cmds = nil, nil
		if err = s.client.Watch(ctx, read, idx); !errors.Is(err, redis.TxFailedErr) {
			break
		}
	}
	if err != nil {
		return nil, storeErr("get steps", err)
	}
	var out []idem.StepRecord
	at := msTime(now)
	for i, name := range names {
		f := cmds[i].Val()
		if len(f) == 0 {
			continue
		}
		rec, err := decodeStep(scope, key, name, f)
		if err != nil {
			return nil, err
		}
		if rec.ExpiresAt.After(at) {
			out = append(out, *rec)
		}
	}
	slices.SortFunc(out, func(a, b idem.StepRecord) int {
		if c := a.StartedAt.Compare(b.StartedAt); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	return out, nil
}

// SettleStep implements idem.StepStore: one Lua script.
func (s *Store) SettleStep(ctx context.Context, scope, key, name string, state idem.StepState, result []byte, now time.Time) error {
	if err := checkStep(name, ""); err != nil {
		return err
	}
	switch state {
	case 0, idem.StepDone, idem.StepFailed:
	default:
		return fmt.Errorf("redisstore: settle step: state %v; settle a step as done or failed, or 0 to forget it", state)
	}
	if err := idem.CheckFieldSize("redisstore", "step result", int64(len(result)), maxBulk); err != nil {
		return err
	}
	n, err := settleStepScript.Run(ctx, s.client, []string{s.stepKey(scope, key, name), s.stepsKey(scope, key)},
		name, strconv.Itoa(int(state)), result, ms(now)).Int()
	if err != nil {
		return storeErr("settle step", err)
	}
	if n == 0 {
		return idem.ErrNotFound
	}
	return nil
}

// DeleteExpiredSteps implements idem.StepStore. It is a no-op that returns
// 0, nil: each step record's hash expires in Redis when its time is up (a
// PEXPIRE of ExpiresAt − Now, raised when BeginStep moves the expiry later).
func (s *Store) DeleteExpiredSteps(context.Context, time.Time, int) (int, error) {
	return 0, nil
}
