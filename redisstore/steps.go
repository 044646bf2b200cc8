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

// stepsKey returns the Redis key of the hash that holds the step records of
// (scope, key): the record's key with ":steps" after it. It has the record's
// hash tag, so that one script may read the record and write the steps on
// Redis Cluster, and it never equals a record's key (those end in '}').
func (s *Store) stepsKey(scope, key string) string {
	return s.recordKey(scope, key) + ":steps"
}

// The fields of one step record in the steps hash: a one-letter kind, ':' and
// the step's name.
const (
	sfState   = "s:" // "1" started, "2" done, "3" failed
	sfOwner   = "o:" // "" once abandoned
	sfDerived = "d:"
	sfStarted = "t:" // Unix ms
	sfExpires = "e:" // Unix ms
	sfResult  = "r:" // absent while started
	sfAttempt = "a:" // the call id of the BeginStep that last began it
	sfCall    = "c:" // the call id of the last FinishStep or AbandonStep
)

var (
	// beginStepScript: KEYS = steps hash, request record. ARGV = name, owner,
	// derived key, now, expiresAt, ttl (expiresAt − now in ms, at least 1),
	// holder ("1" or ""), rerun ("1" or ""), call id. Reply: {0} when the
	// Holder fence failed; else {began, state, owner, derived key, started,
	// expires, result}. The fence reads the request record as claimScript
	// wrote it (state "1", token, expires), in the same atomic step. A re-run
	// of the same call (go-redis re-sends a command whose reply was lost)
	// finds its own call id and answers began again. The hash's Redis expiry
	// is raised to ttl when shorter, never lowered.
	beginStepScript = redis.NewScript(`
local h, n = KEYS[1], ARGV[1]
local now = tonumber(ARGV[4])
if ARGV[7] == '1' then
  local r = redis.call('HMGET', KEYS[2], 'state', 'token', 'expires')
  if r[1] ~= '1' or r[2] ~= ARGV[2] or not r[3] or tonumber(r[3]) <= now then
    return {0}
  end
end
local fs, fo, fd, ft, fe, fr, fa, fc = 's:'..n, 'o:'..n, 'd:'..n, 't:'..n, 'e:'..n, 'r:'..n, 'a:'..n, 'c:'..n
local cur = redis.call('HMGET', h, fs, fo, fe, fa)
local began = 0
if not cur[1] or tonumber(cur[3]) <= now then
  redis.call('HDEL', h, fr, fc)
  redis.call('HSET', h, fs, '1', fo, ARGV[2], fd, ARGV[3], ft, ARGV[4], fe, ARGV[5], fa, ARGV[9])
  began = 1
else
  if cur[1] == '1' and cur[4] == ARGV[9] and cur[2] == ARGV[2] then
    began = 1
  elseif cur[1] == '1' and (cur[2] == '' or (ARGV[8] == '1' and cur[2] ~= ARGV[2])) then
    redis.call('HSET', h, fo, ARGV[2], fa, ARGV[9])
    began = 1
  end
  if tonumber(cur[3]) < tonumber(ARGV[5]) then
    redis.call('HSET', h, fe, ARGV[5])
  end
end
local ttl = redis.call('PTTL', h)
if ttl < tonumber(ARGV[6]) then
  redis.call('PEXPIRE', h, ARGV[6])
end
local rec = redis.call('HMGET', h, fs, fo, fd, ft, fe, fr)
return {began, rec[1], rec[2], rec[3], rec[4], rec[5], rec[6]}
`)

	// endStepScript: KEYS = steps hash. ARGV = name, owner, now, call id,
	// then the fields to set ("s"/"r"/"o" and values, without the name).
	// Reply: 1 done, 0 lock lost (no live started record of owner). A re-run
	// of the same call finds its call id and answers 1.
	endStepScript = redis.NewScript(`
local h, n = KEYS[1], ARGV[1]
local cur = redis.call('HMGET', h, 's:'..n, 'o:'..n, 'e:'..n, 'c:'..n)
if cur[4] == ARGV[4] then
  return 1
end
if cur[1] ~= '1' or ARGV[2] == '' or cur[2] ~= ARGV[2] or tonumber(cur[3]) <= tonumber(ARGV[3]) then
  return 0
end
local set = {'c:'..n, ARGV[4]}
for i = 5, #ARGV - 1, 2 do
  set[#set + 1] = ARGV[i]..':'..n
  set[#set + 1] = ARGV[i + 1]
end
redis.call('HSET', h, unpack(set))
return 1
`)

	// settleStepScript: KEYS = steps hash. ARGV = name, state ("0" forgets
	// the record), result, now. Reply: 1 done, 0 no live record.
	settleStepScript = redis.NewScript(`
local h, n = KEYS[1], ARGV[1]
local cur = redis.call('HMGET', h, 's:'..n, 'e:'..n)
if not cur[1] or tonumber(cur[2]) <= tonumber(ARGV[4]) then
  return 0
end
if ARGV[2] == '0' then
  redis.call('HDEL', h, 's:'..n, 'o:'..n, 'd:'..n, 't:'..n, 'e:'..n, 'r:'..n, 'a:'..n, 'c:'..n)
else
  redis.call('HSET', h, 's:'..n, ARGV[2], 'r:'..n, ARGV[3])
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
	res, err := beginStepScript.Run(ctx, s.client, []string{s.stepsKey(req.Scope, req.Key), s.recordKey(req.Scope, req.Key)},
		req.Name, req.Owner, req.DerivedKey, ms(req.Now), ms(req.ExpiresAt), ttl(req.Now, req.ExpiresAt),
		flag(req.Holder), flag(req.Rerun), callID()).Slice()
	if err != nil {
		return nil, false, storeErr("begin step", err)
	}
	if len(res) == 1 {
		return nil, false, idem.ErrLockLost
	}
	if len(res) != 7 {
		return nil, false, fmt.Errorf("redisstore: begin step: unexpected reply of %d values", len(res))
	}
	began, _ := res[0].(int64)
	f := map[string]string{}
	for i, name := range []string{sfState, sfOwner, sfDerived, sfStarted, sfExpires, sfResult} {
		if v, ok := res[i+1].(string); ok {
			f[name+req.Name] = v
		}
	}
	rec, err := decodeStep(req.Scope, req.Key, req.Name, f)
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

// decodeStep reads step name's record from the fields of the steps hash.
func decodeStep(scope, key, name string, f map[string]string) (*idem.StepRecord, error) {
	state, err := strconv.Atoi(f[sfState+name])
	if err != nil || state < int(idem.StepStarted) || state > int(idem.StepFailed) {
		return nil, fmt.Errorf("redisstore: step %q of a record: malformed state %q; the hash was changed outside idem", name, f[sfState+name])
	}
	started, err1 := strconv.ParseInt(f[sfStarted+name], 10, 64)
	expires, err2 := strconv.ParseInt(f[sfExpires+name], 10, 64)
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("redisstore: step %q of a record: malformed times; the hash was changed outside idem", name)
	}
	rec := &idem.StepRecord{Scope: scope, Key: key, Name: name, State: idem.StepState(state),
		Owner: f[sfOwner+name], DerivedKey: f[sfDerived+name],
		StartedAt: time.UnixMilli(started), ExpiresAt: time.UnixMilli(expires)}
	if r, ok := f[sfResult+name]; ok && rec.State != idem.StepStarted {
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
	n, err := endStepScript.Run(ctx, s.client, []string{s.stepsKey(scope, key)},
		name, owner, ms(now), callID(), "s", strconv.Itoa(int(state)), "r", result).Int()
	return fenced("finish step", n, err)
}

// AbandonStep implements idem.StepStore: one fenced Lua script.
func (s *Store) AbandonStep(ctx context.Context, scope, key, name, owner string, now time.Time) error {
	if err := checkStep(name, owner); err != nil {
		return err
	}
	n, err := endStepScript.Run(ctx, s.client, []string{s.stepsKey(scope, key)},
		name, owner, ms(now), callID(), "o", "").Int()
	return fenced("abandon step", n, err)
}

// GetSteps implements idem.StepStore with one HGETALL.
func (s *Store) GetSteps(ctx context.Context, scope, key string, now time.Time) ([]idem.StepRecord, error) {
	f, err := s.client.HGetAll(ctx, s.stepsKey(scope, key)).Result()
	if err != nil {
		return nil, storeErr("get steps", err)
	}
	var out []idem.StepRecord
	at := msTime(now)
	for field := range f {
		name, ok := strings.CutPrefix(field, sfState)
		if !ok {
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
	n, err := settleStepScript.Run(ctx, s.client, []string{s.stepsKey(scope, key)},
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
// 0, nil: the steps hash of a record expires in Redis with the latest of its
// steps' expiries (step records expire with their request record).
func (s *Store) DeleteExpiredSteps(context.Context, time.Time, int) (int, error) {
	return 0, nil
}
