package redisstore

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem"
)

// DefaultPrefix is the key prefix used when Config.Prefix is empty.
const DefaultPrefix = "idem:"

// Config configures a Store. A nil *Config means all defaults. New copies and
// validates it; the caller's struct is never modified.
type Config struct {
	// Prefix starts every Redis key the store writes, so that several stores (or
	// applications) can share one Redis database. It must not contain '{' or '}':
	// the record's hash tag follows it. Defaults to "idem:".
	Prefix string
}

// Store is an idem.Store on Redis. It is safe for concurrent use. Its zero value
// is not usable; call New.
//
// Store is not an idem.TxStore: Redis cannot share a transaction with the
// business database (see the package documentation, "Guarantees").
type Store struct {
	client redis.UniversalClient
	prefix string
	sub    subscriber // the pub/sub connection of idem.OutcomeNotifier
}

var _ idem.Store = (*Store)(nil)

// New returns a store that keeps records in Redis through client, which may be a
// single-node, Sentinel (failover) or Cluster client. New does no I/O; the Lua
// scripts are loaded on first use (EVALSHA, falling back to EVAL on NOSCRIPT).
// It returns an error, saying what to change, when client is nil or cfg is
// invalid.
func New(client redis.UniversalClient, cfg *Config) (*Store, error) {
	if client == nil {
		return nil, errors.New("redisstore: New needs a Redis client (try redisstore.New(redis.NewClient(&redis.Options{Addr: \"localhost:6379\"}), nil), or redis.NewUniversalClient for Sentinel and Cluster)")
	}
	var c Config
	if cfg != nil {
		c = *cfg
	}
	if c.Prefix == "" {
		c.Prefix = DefaultPrefix
	}
	if strings.ContainsAny(c.Prefix, "{}") {
		return nil, fmt.Errorf("redisstore: Config.Prefix %q contains '{' or '}', which would change the Redis Cluster hash tag of every key; choose a prefix without braces, such as \"idem:\"", c.Prefix)
	}
	return &Store{client: client, prefix: c.Prefix}, nil
}

// Prefix returns the key prefix in use (Config.Prefix or its default): every key
// the store writes starts with it.
func (s *Store) Prefix() string { return s.prefix }

// ExpiresRecordsItself reports true: Redis deletes every record when its time
// is up (a PEXPIRE of ExpiresAt − Now), so DeleteExpired has nothing to do. It
// implements storetest.SelfExpiring.
func (s *Store) ExpiresRecordsItself() bool { return true }

// Claim implements idem.Store with one Lua script: the decision and the write
// are a single atomic step on the server. A claimed record expires in Redis
// after ExpiresAt − Now.
func (s *Store) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if err := idem.CheckFieldSize("redisstore", "fingerprint", int64(len(req.Fingerprint)), maxBulk); err != nil {
		return nil, false, err
	}
	res, err := claimScript.Run(ctx, s.client, []string{s.recordKey(req.Scope, req.Key)},
		req.Fingerprint, req.Token, ms(req.Now), ms(req.LeaseUntil), ms(req.ExpiresAt), ttl(req.Now, req.ExpiresAt)).Result()
	if err != nil {
		return nil, false, storeErr("claim", err)
	}
	switch v := res.(type) {
	case string: // claimed: the reply is the record's created time
		created, err := strconv.ParseInt(v, 10, 64)
		if err != nil {
			return nil, false, fmt.Errorf("redisstore: claim: malformed reply %q", v)
		}
		return &idem.Record{
			Scope: req.Scope, Key: req.Key, State: idem.StateInFlight,
			Fingerprint: req.Fingerprint, Token: req.Token, CreatedAt: time.UnixMilli(created),
			LeaseUntil: msTime(req.LeaseUntil), ExpiresAt: msTime(req.ExpiresAt),
		}, true, nil
	case []any: // not claimed: the reply is the existing record (HGETALL)
		fields := make(map[string]string, len(v)/2)
		for i := 0; i+1 < len(v); i += 2 {
			k, _ := v[i].(string)
			val, _ := v[i+1].(string)
			fields[k] = val
		}
		rec, err := decodeRecord(req.Scope, req.Key, fields)
		if err != nil {
			return nil, false, err
		}
		return rec, false, nil
	}
	return nil, false, fmt.Errorf("redisstore: claim: unexpected reply %T from the claim script", res)
}

// maxBulk is the longest value Redis takes as one argument by default
// (proto-max-bulk-len, 512 MB).
const maxBulk = 512<<20 - 1

// Complete implements idem.Store: one fenced Lua script stores resp, marks the
// record complete and sets its Redis expiry to expiresAt − now from now on.
func (s *Store) Complete(ctx context.Context, scope, key, token string, resp *idem.Response, now, expiresAt time.Time) error {
	if resp == nil {
		return errors.New("redisstore: Complete needs a non-nil *idem.Response")
	}
	omitted := ""
	body := resp.Body
	if resp.BodyOmitted {
		omitted, body = "1", nil
	}
	hdr := encodeHeader(resp.Header)
	for _, f := range [...]struct {
		name string
		size int
	}{{"headers", len(hdr)}, {"body", len(body)}, {"ref", len(resp.Ref)}} {
		if err := idem.CheckFieldSize("redisstore", f.name, int64(f.size), maxBulk); err != nil {
			return err
		}
	}
	n, err := completeScript.Run(ctx, s.client, []string{s.recordKey(scope, key)},
		token, ms(expiresAt), ttl(now, expiresAt), callID(),
		fStatus, strconv.Itoa(resp.Status),
		fHeaders, hdr,
		fBody, body,
		fOmitted, omitted,
		fRef, resp.Ref).Int()
	return fenced("complete", n, err)
}

// Release implements idem.Store: one fenced Lua script deletes the in-flight
// record held under token.
func (s *Store) Release(ctx context.Context, scope, key, token string) error {
	n, err := releaseScript.Run(ctx, s.client, []string{s.recordKey(scope, key)}, token).Int()
	return fenced("release", n, err)
}

// Extend implements idem.Store: one fenced Lua script moves the lease deadline,
// raises ExpiresAt to leaseUntil when it is earlier, and raises the Redis
// expiry to at least twice leaseUntil − now, so that Redis never deletes a
// record whose lease is live, however long its handler runs past the TTL. The
// extra lease lets a renewal that arrives after the deadline (a stalled
// application, a slow network) still find the record and keep it when no other
// request took it over meanwhile, as the SQL stores do, whose rows stay stored;
// Claim, Get and the other scripts go by the stored times, so the record counts
// as lapsed and expired all the same.
func (s *Store) Extend(ctx context.Context, scope, key, token string, now, leaseUntil time.Time) error {
	n, err := extendScript.Run(ctx, s.client, []string{s.recordKey(scope, key)}, token, ms(leaseUntil), ttl(now, leaseUntil.Add(leaseUntil.Sub(now)))).Int()
	return fenced("extend", n, err)
}

// Get implements idem.Store with one HGETALL. A record whose ExpiresAt <= now is
// reported as ErrNotFound even if Redis has not deleted it yet.
func (s *Store) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	fields, err := s.client.HGetAll(ctx, s.recordKey(scope, key)).Result()
	if err != nil {
		return nil, storeErr("get", err)
	}
	if len(fields) == 0 {
		return nil, idem.ErrNotFound
	}
	rec, err := decodeRecord(scope, key, fields)
	if err != nil {
		return nil, err
	}
	if !rec.ExpiresAt.After(msTime(now)) {
		return nil, idem.ErrNotFound
	}
	return rec, nil
}

// DeleteExpired implements idem.Store. It is a no-op that returns 0, nil: Redis
// expires records itself, ExpiresAt − Now after they were written. Running an idem.Janitor on this
// store is harmless and useless.
func (s *Store) DeleteExpired(context.Context, time.Time, int) (int, error) {
	return 0, nil
}

// fenced turns a fenced script's reply into ErrLockLost (0) or success (1).
func fenced(op string, n int, err error) error {
	switch {
	case err != nil:
		return storeErr(op, err)
	case n == 0:
		return idem.ErrLockLost
	}
	return nil
}

// storeErr wraps a Redis error, with a hint for the errors an operator can fix.
func storeErr(op string, err error) error {
	msg := err.Error()
	switch {
	case strings.HasPrefix(msg, "OOM "):
		return fmt.Errorf("redisstore: %s: %w (Redis is at maxmemory with noeviction: raise maxmemory or shorten the idem TTL; do not switch to an evicting policy, which would drop records and cause duplicate executions)", op, err)
	case strings.HasPrefix(msg, "WRONGTYPE "):
		return fmt.Errorf("redisstore: %s: %w (another program writes keys under this store's prefix; give the store its own Config.Prefix)", op, err)
	case strings.HasPrefix(msg, "NOSCRIPT ") || strings.HasPrefix(msg, "ERR unknown command"):
		return fmt.Errorf("redisstore: %s: %w (the server must allow EVAL and EVALSHA: Redis 4.0 or later, or a compatible server with Lua scripting enabled)", op, err)
	}
	return fmt.Errorf("redisstore: %s: %w", op, err)
}

// ms returns t as Unix milliseconds, the resolution of Redis expiry.
func ms(t time.Time) int64 { return t.UnixMilli() }

// msTime truncates t to the millisecond, as the store keeps it.
func msTime(t time.Time) time.Time { return time.UnixMilli(t.UnixMilli()) }

// ttl returns at − now in milliseconds, at least 1, as the decimal string a
// script passes to PEXPIRE. Redis expiry is set as a duration, never as an
// instant: the instant is on the middleware's clock, which need not agree with
// the Redis server's (a PEXPIREAT of a clock running behind would delete a live
// record at once). A time already past gives 1 ms: the record was already
// expired for the caller, and Redis drops it at once.
func ttl(now, at time.Time) string {
	return strconv.FormatInt(max(1, at.UnixMilli()-now.UnixMilli()), 10)
}

// callID returns a fresh random id for one Complete call, which lets the script
// tell a re-send of that call from another call.
func callID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return base64.RawURLEncoding.EncodeToString(b[:])
}
