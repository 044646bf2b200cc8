// Package storetest checks idem.Store implementations: the conformance suite
// Run (described below) and, as its Linearizable subtest, a linearizability
// check (RunLinearizability, CheckLinearizability). The check runs many
// goroutines of random operations on a few keys of one store, records every
// call and return, and checks with porcupine that the history is linearizable
// against a sequential model of one record, partitioned by key.
//
// Time is a logical clock the workload drives: the now of every call is read
// from it, and goroutines advance it by random jumps past leases and TTLs, so
// that lapses and expiry happen by the clock and the model computes every
// decision exactly. The clock never runs slower than real time, so a backend
// that expires records by itself (Redis) never expires one before the logical
// clock has passed its expiry.
//
// An operation whose outcome is unknown (its deadline hit, its connection died:
// any error that is not a contract sentinel) is kept, Jepsen-style, as one that
// returns at the end of the history and may or may not have taken effect.
//
// Long runs: the environment variable IDEM_LINEARIZABILITY_OPS sets the length
// of the check per store, as a number of operations (200000) or a duration
// (5m); the default is a short run of 500 operations for CI. The history is
// checked in rounds of fresh keys, so a long run's memory and checking time
// stay bounded:
//
//	IDEM_LINEARIZABILITY_OPS=5m go test -run '^TestConformance$/Linearizable' -timeout 30m ./sqlitestore/
package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/idemkit/idem"
)

// LinearizabilityEnv is the environment variable that sets the length of the
// linearizability check: a number of operations (200000) or a duration (5m).
const LinearizabilityEnv = "IDEM_LINEARIZABILITY_OPS"

// LinearizabilityOptions tunes CheckLinearizability. The zero value is the short
// CI run (or what LinearizabilityEnv asks for).
type LinearizabilityOptions struct {
	// Ops is the number of operations to run. Default: 500, or LinearizabilityEnv.
	Ops int
	// Duration, when set, runs rounds until it has passed (instead of Ops).
	Duration time.Duration
	// RoundOps is the number of operations per round; each round works on fresh
	// keys and is checked on its own. Default 2000.
	RoundOps int
	// Clients is the number of concurrent goroutines. Default 8.
	Clients int
	// Keys is the number of keys per round. Default 3.
	Keys int
	// CallTimeout bounds each store call; a call that hits it has an unknown
	// outcome. Default 10s.
	CallTimeout time.Duration
	// CheckTimeout bounds porcupine's search per round. Default 1m. A search
	// that times out is reported as a failure (nothing was proven).
	CheckTimeout time.Duration
	// Seed makes the random choices repeatable (the interleaving is not).
	// Default: random.
	Seed uint64
	// NoTx leaves the transactional completion out even for an idem.TxStore.
	NoTx bool
	// Fault, when set, is called every FaultInterval while the operations run,
	// to break the store's connections mid-call (for example the Cut method of
	// an internal/faults Proxy the store dials through). Calls that fail are
	// recorded with unknown outcomes.
	Fault func()
	// FaultInterval is how often Fault is called. Default 25ms.
	FaultInterval time.Duration
}

// LinearizabilityResult is what CheckLinearizability found.
type LinearizabilityResult struct {
	// Ops is the number of operations run; Unknown how many of them had an
	// unknown outcome; Aborted how many transactional completions reported
	// idem.ErrTxAborted; Rounds how many rounds were checked.
	Ops, Unknown, Aborted, Rounds int
	// UnknownErrors holds up to three of the errors that made outcomes unknown.
	UnknownErrors []string
	// Counts is the number of operations of each kind.
	Counts map[string]int
	// Linearizable is true when every round was proven linearizable.
	Linearizable bool
	// Problem says what failed: a non-linearizable round (with its
	// counterexample), a search that timed out, or a broken count.
	Problem string
	// Visualization is the path of porcupine's HTML visualisation of the
	// failing round; empty when every round passed.
	Visualization string
	// Duration is the wall time of the whole run, checking included.
	Duration time.Duration
}

// RunLinearizability runs CheckLinearizability against s and fails t with the
// counterexample and the path of the visualisation when the history is not
// linearizable, and when a call failed with a store error although opts sets no
// Fault. opts may be nil.
func RunLinearizability(t *testing.T, s idem.Store, opts *LinearizabilityOptions) {
	t.Helper()
	var o LinearizabilityOptions
	if opts != nil {
		o = *opts
	}
	ctx := context.Background()
	if d, ok := t.Deadline(); ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, d.Add(-10*time.Second))
		defer cancel()
	}
	res, err := CheckLinearizability(ctx, s, o)
	if err != nil {
		t.Fatalf("linearizability check: %v", err)
	}
	t.Logf("linearizability: %d operations in %d rounds (%d unknown outcomes, %d aborted transactions) in %v; %v",
		res.Ops, res.Rounds, res.Unknown, res.Aborted, res.Duration.Round(time.Millisecond), fmtCounts(res.Counts))
	for _, e := range res.UnknownErrors {
		t.Logf("an unknown outcome: %s", e)
	}
	if res.Unknown > 0 && o.Fault == nil {
		// Without an injected fault, a store error is a defect too: each would be a
		// 503 to a client (seen: MariaDB claims that deadlocked with each other).
		t.Errorf("%d of %d operations failed with a store error although no fault was injected, for example %q", res.Unknown, res.Ops, res.UnknownErrors)
	}
	if !res.Linearizable {
		t.Errorf("%s\nvisualisation: %s", res.Problem, res.Visualization)
	}
}

func testLinearizable(t *testing.T, s idem.Store) { RunLinearizability(t, s, nil) }

func fmtCounts(m map[string]int) string {
	names := make([]string, 0, len(m))
	for n := range m {
		names = append(names, n)
	}
	sort.Strings(names)
	parts := make([]string, 0, len(names))
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s=%d", n, m[n]))
	}
	return strings.Join(parts, " ")
}

// parseLinearizabilityEnv reads LinearizabilityEnv into o when o sets neither
// Ops nor Duration.
func parseLinearizabilityEnv(o *LinearizabilityOptions) error {
	v := strings.TrimSpace(os.Getenv(LinearizabilityEnv))
	if v == "" || o.Ops > 0 || o.Duration > 0 {
		return nil
	}
	if n, err := strconv.Atoi(v); err == nil && n > 0 {
		o.Ops = n
		return nil
	}
	if d, err := time.ParseDuration(v); err == nil && d > 0 {
		o.Duration = d
		return nil
	}
	return fmt.Errorf("%s=%q: want a number of operations (200000) or a duration (5m)", LinearizabilityEnv, v)
}

// CheckLinearizability runs the workload against s and checks its history. It
// returns an error only when the check could not run; a store that is not
// linearizable is reported in the result.
func CheckLinearizability(ctx context.Context, s idem.Store, o LinearizabilityOptions) (*LinearizabilityResult, error) {
	if err := parseLinearizabilityEnv(&o); err != nil {
		return nil, err
	}
	if o.Ops <= 0 && o.Duration <= 0 {
		o.Ops = 500
	}
	if o.RoundOps <= 0 {
		o.RoundOps = 2000
	}
	if o.Clients <= 0 {
		o.Clients = 8
	}
	if o.Keys <= 0 {
		o.Keys = 3
	}
	if o.CallTimeout <= 0 {
		o.CallTimeout = 10 * time.Second
	}
	if o.CheckTimeout <= 0 {
		o.CheckTimeout = time.Minute
	}
	if o.FaultInterval <= 0 {
		o.FaultInterval = 25 * time.Millisecond
	}
	if o.Seed == 0 {
		o.Seed = rand.Uint64()
	}
	start := time.Now()
	res := &LinearizabilityResult{Counts: map[string]int{}, Linearizable: true}
	clock := newLogicalClock()
	scope := "lin-" + strconv.FormatUint(rand.Uint64(), 36)
	for round := 0; ; round++ {
		n := o.RoundOps
		if o.Duration > 0 {
			if time.Since(start) >= o.Duration {
				break
			}
		} else {
			if res.Ops >= o.Ops {
				break
			}
			n = min(n, o.Ops-res.Ops)
		}
		if err := ctx.Err(); err != nil {
			if res.Rounds > 0 {
				break // out of time: report what was checked
			}
			return nil, err
		}
		w := &workload{store: s, opts: o, clock: clock, round: round, scope: scope}
		w.txStore, _ = s.(idem.TxStore)
		if o.NoTx {
			w.txStore = nil
		}
		history := w.run(ctx, n, o.Seed+uint64(round))
		res.Rounds++
		res.Ops += n
		res.Unknown += int(w.unknown.Load())
		res.Aborted += int(w.aborted.Load())
		for _, e := range w.errs {
			if len(res.UnknownErrors) < 3 {
				res.UnknownErrors = append(res.UnknownErrors, e)
			}
		}
		for k, c := range w.counts() {
			res.Counts[k] += c
		}
		if p := w.countProblem(); p != "" {
			res.Linearizable, res.Problem = false, fmt.Sprintf("round %d: %s", round, p)
			break
		}
		model := linModel()
		verdict, info := porcupine.CheckOperationsVerbose(model, history, o.CheckTimeout)
		if verdict == porcupine.Ok {
			continue
		}
		res.Linearizable = false
		if verdict == porcupine.Unknown {
			res.Problem = fmt.Sprintf("round %d (seed %d): porcupine's search timed out after %v on %d operations: linearizability was not proven; raise CheckTimeout or lower RoundOps",
				round, o.Seed+uint64(round), o.CheckTimeout, len(history))
		} else {
			res.Problem = fmt.Sprintf("round %d (seed %d): the history of %d operations is NOT linearizable.\n%s",
				round, o.Seed+uint64(round), len(history), counterexample(model, history, o.CheckTimeout))
		}
		res.Visualization = writeVisualization(model, info)
		break
	}
	res.Duration = time.Since(start)
	return res, nil
}

// writeVisualization writes porcupine's HTML visualisation to a file that
// outlives the test and returns its path (or why it could not).
func writeVisualization(model porcupine.Model, info porcupine.LinearizationInfo) string {
	dir, err := os.MkdirTemp("", "idem-linearizability-")
	if err != nil {
		return "(not written: " + err.Error() + ")"
	}
	path := filepath.Join(dir, "history.html")
	if err := porcupine.VisualizePath(model, info, path); err != nil {
		return "(not written: " + err.Error() + ")"
	}
	return path
}

// counterexample describes, for the first key whose history is not
// linearizable, the longest prefix that could be linearized (with the state
// after each step) and the operations that could not follow it.
func counterexample(model porcupine.Model, history []porcupine.Operation, timeout time.Duration) string {
	single := model
	single.Partition, single.PartitionEvent = nil, nil
	for _, part := range linPartition(history) {
		verdict, info := porcupine.CheckOperationsVerbose(single, part, timeout)
		if verdict != porcupine.Illegal {
			continue
		}
		var longest []porcupine.Operation
		for _, p := range info.PartialLinearizationsOperations() {
			for _, lin := range p {
				if len(lin) > len(longest) {
					longest = lin
				}
			}
		}
		var b strings.Builder
		key := -1
		for _, op := range part {
			if k := op.Input.(linInput).Key; k >= 0 {
				key = k
				break
			}
		}
		fmt.Fprintf(&b, "key k%d: %d operations; the longest linearizable prefix has %d. Its last steps:\n", key, len(part), len(longest))
		state := model.Init()
		done := map[[2]int64]bool{}
		for i, op := range longest {
			_, state = model.Step(state, op.Input, op.Output)
			done[[2]int64{op.Call, int64(op.ClientId)}] = true
			if i >= len(longest)-6 {
				fmt.Fprintf(&b, "  %s\n      state after: %s\n", describeTimed(op), model.DescribeState(state))
			}
		}
		var pending []porcupine.Operation
		for _, op := range part {
			if !done[[2]int64{op.Call, int64(op.ClientId)}] {
				pending = append(pending, op)
			}
		}
		if len(pending) > 0 {
			first := pending[0].Return
			for _, op := range pending {
				first = min(first, op.Return)
			}
			b.WriteString("none of these operations (each began before the earliest pending one returned) can come next:\n")
			for _, op := range pending {
				if op.Call <= first {
					fmt.Fprintf(&b, "  %s\n", describeTimed(op))
				}
			}
		}
		return b.String()
	}
	return "(no single key's history is illegal on its own: see the visualisation)"
}

// describeTimed describes an operation with its client and its real call and
// return times (milliseconds since the round began).
func describeTimed(op porcupine.Operation) string {
	ret := fmt.Sprintf("%.3f", float64(op.Return)/1e6)
	if op.Output.(linOutput).Result == resUnknown {
		ret = "end"
	}
	return fmt.Sprintf("client %d [%.3f–%s ms]: %s", op.ClientId, float64(op.Call)/1e6, ret, describeOp(op.Input, op.Output))
}

// logicalClock is the clock the workload reads every now from: real time since
// the start plus the jumps goroutines add, in whole milliseconds since base.
type logicalClock struct {
	base   time.Time
	start  time.Time
	offset atomic.Int64
}

func newLogicalClock() *logicalClock {
	now := time.Now()
	return &logicalClock{base: time.UnixMilli(now.UnixMilli()), start: now}
}

// now returns the clock reading in milliseconds since base.
func (c *logicalClock) now() int64 { return time.Since(c.start).Milliseconds() + c.offset.Load() }

// at converts a reading to a time.
func (c *logicalClock) at(ms int64) time.Time {
	return c.base.Add(time.Duration(ms) * time.Millisecond)
}

// Logical durations of the workload.
const (
	linLeaseShort = 10_000
	linLeaseLong  = 30_000
	linTTLShort   = 60_000
	linTTLLong    = 120_000
	linLimit      = 100 // DeleteExpired's limit: more than a round's keys
)

// workload is one round: fresh keys, a shared token pool, a recorded history.
type workload struct {
	store   idem.Store
	txStore idem.TxStore
	opts    LinearizabilityOptions
	clock   *logicalClock
	round   int
	scope   string
	start   time.Time

	mu      sync.Mutex
	tokens  [][]string // per key: tokens of claims that succeeded or may have
	history []porcupine.Operation
	kinds   map[string]int
	deleted []int    // counts DeleteExpired reported
	errs    []string // the first errors of unknown outcomes
	seq     atomic.Int64
	unknown atomic.Int64
	aborted atomic.Int64
}

func (w *workload) keyName(k int) string { return fmt.Sprintf("r%d-k%d", w.round, k) }

func (w *workload) ts() int64 { return time.Since(w.start).Nanoseconds() }

func (w *workload) counts() map[string]int { return w.kinds }

// countProblem checks what the per-key model cannot: the counts DeleteExpired
// reported are within its limit, and zero for a store that expires records by
// itself.
func (w *workload) countProblem() string {
	self := false
	if se, ok := w.store.(SelfExpiring); ok && se.ExpiresRecordsItself() {
		self = true
	}
	keys := (w.round + 1) * w.opts.Keys // this round's and the earlier rounds'
	for _, n := range w.deleted {
		if n < 0 || n > linLimit || n > keys {
			return fmt.Sprintf("DeleteExpired(limit %d) reported %d deleted records; the store has held only %d keys", linLimit, n, keys)
		}
		if self && n != 0 {
			return fmt.Sprintf("a self-expiring store's DeleteExpired reported %d deleted records, want 0", n)
		}
	}
	return ""
}

// run runs n operations from opts.Clients goroutines and returns the history.
func (w *workload) run(ctx context.Context, n int, seed uint64) []porcupine.Operation {
	w.start = time.Now()
	w.tokens = make([][]string, w.opts.Keys)
	w.kinds = map[string]int{}
	var left atomic.Int64
	left.Store(int64(n))
	var wg sync.WaitGroup
	for c := range w.opts.Clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(c)))
			for left.Add(-1) >= 0 && ctx.Err() == nil {
				w.one(ctx, rng, c)
			}
		}()
	}
	stopFaults := make(chan struct{})
	var faults sync.WaitGroup
	if w.opts.Fault != nil {
		faults.Add(1)
		go func() {
			defer faults.Done()
			tick := time.NewTicker(w.opts.FaultInterval)
			defer tick.Stop()
			for {
				select {
				case <-stopFaults:
					return
				case <-tick.C:
					w.opts.Fault()
				}
			}
		}()
	}
	wg.Wait()
	close(stopFaults)
	faults.Wait()
	end := w.ts() + 1
	horizon := w.clock.now() + 1
	for i := range w.history {
		if w.history[i].Output.(linOutput).Result == resUnknown {
			w.history[i].Return = end
			in := w.history[i].Input.(linInput)
			in.Horizon = horizon
			w.history[i].Input = in
		}
	}
	return w.history
}

// pickToken returns a token of key k: mostly the latest claim's, sometimes an
// older (stale) one or one that never claimed anything.
func (w *workload) pickToken(rng *rand.Rand, k int) string {
	w.mu.Lock()
	defer w.mu.Unlock()
	toks := w.tokens[k]
	switch r := rng.IntN(10); {
	case len(toks) == 0 || r == 0:
		return "never-claimed"
	case r < 7:
		return toks[len(toks)-1]
	default:
		return toks[rng.IntN(len(toks))]
	}
}

func (w *workload) addToken(k int, tok string) {
	w.mu.Lock()
	w.tokens[k] = append(w.tokens[k], tok)
	w.mu.Unlock()
}

// advance moves the logical clock by a random jump: a little, past a lease, or
// past a TTL.
func (w *workload) advance(rng *rand.Rand) {
	var d int64
	switch rng.IntN(4) {
	case 0:
		d = 1 + rng.Int64N(5_000)
	case 1:
		d = linLeaseShort + rng.Int64N(linLeaseLong)
	case 2:
		d = linTTLShort + rng.Int64N(linTTLLong)
	default:
		d = rng.Int64N(2 * linTTLLong)
	}
	w.clock.offset.Add(d)
}

// one runs one random operation and records it.
func (w *workload) one(ctx context.Context, rng *rand.Rand, client int) {
	if rng.IntN(100) < 6 {
		w.advance(rng)
	}
	k := rng.IntN(w.opts.Keys)
	key := w.keyName(k)
	in := linInput{Key: k, Ident: w.scope + "\x00" + key}
	lease := []int64{linLeaseShort, linLeaseLong}[rng.IntN(2)]
	ttl := []int64{linTTLShort, linTTLLong}[rng.IntN(2)]
	seq := w.seq.Add(1)
	switch r := rng.IntN(100); {
	case r < 30:
		in.Kind = kindClaim
		in.FP = []string{"v2:a", "v2:b"}[rng.IntN(2)]
		in.Token = fmt.Sprintf("t%d", seq)
	case r < 48:
		in.Kind = kindComplete
		if w.txStore != nil && rng.IntN(2) == 0 {
			in.Kind = kindTxComplete
		}
		in.Token = w.pickToken(rng, k)
		in.Resp = fmt.Sprint(seq)
		if rng.IntN(16) == 0 {
			in.Resp = "big" + in.Resp // a Ref some stores refuse (ErrFieldTooLarge)
		}
	case r < 56:
		in.Kind = kindRelease
		in.Token = w.pickToken(rng, k)
	case r < 72:
		in.Kind = kindExtend
		in.Token = w.pickToken(rng, k)
		if rng.IntN(2) == 0 {
			lease = linTTLShort // a renewal that runs past the record's expiry
		}
	case r < 97:
		in.Kind = kindGet
	default:
		in.Kind, in.Key, in.Ident, in.Limit = kindDeleteExpired, -1, "", linLimit
	}
	call := w.ts()
	in.Now = w.clock.now()
	in.Lease = in.Now + lease
	in.Expires = in.Now + ttl
	if in.Kind == kindClaim {
		// The claim's own expiry is never before its lease.
		in.Expires = max(in.Expires, in.Lease)
	}
	out := w.do(ctx, in, key)
	ret := w.ts()
	in.Horizon = w.clock.now() + 1
	if in.Kind == kindClaim && (out.Claimed || out.Result == resUnknown) {
		w.addToken(k, in.Token)
	}
	if out.Result == resUnknown {
		w.unknown.Add(1)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.kinds[in.Kind.String()]++
	if out.Result == resUnknown && len(w.errs) < 3 {
		w.errs = append(w.errs, in.Kind.String()+": "+out.Err)
	}
	if in.Kind == kindDeleteExpired && out.Result == resOK {
		w.deleted = append(w.deleted, out.N)
	}
	if in.Kind == kindGet && out.Result == resUnknown {
		return // a read that may not have happened constrains nothing
	}
	w.history = append(w.history, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
}

// observe converts a record a store returned.
func (w *workload) observe(rec *idem.Record) linRecord {
	if rec == nil {
		return linRecord{Ident: "<nil record>"}
	}
	base := w.clock.base.UnixMilli()
	r := linRecord{
		Present: true, State: rec.State, FP: rec.Fingerprint, Token: rec.Token,
		Created: rec.CreatedAt.UnixMilli() - base, Lease: rec.LeaseUntil.UnixMilli() - base,
		Expires: rec.ExpiresAt.UnixMilli() - base, Ident: rec.Scope + "\x00" + rec.Key,
	}
	if rec.State == idem.StateComplete || rec.Response != nil {
		r.Resp = canonicalResponse(rec.Response)
	}
	return r
}

// classify turns an error into a result: the contract's sentinels are definite
// outcomes, anything else is unknown.
func classify(err error) (linResult, string) {
	switch {
	case err == nil:
		return resOK, ""
	case errors.Is(err, idem.ErrLockLost):
		return resLockLost, ""
	case errors.Is(err, idem.ErrNotFound):
		return resNotFound, ""
	case errors.Is(err, idem.ErrFieldTooLarge):
		return resRefused, ""
	case errors.Is(err, idem.ErrTxAborted):
		return resAborted, ""
	}
	return resUnknown, err.Error()
}

// do calls the store.
func (w *workload) do(ctx context.Context, in linInput, key string) linOutput {
	ctx, cancel := context.WithTimeout(ctx, w.opts.CallTimeout)
	defer cancel()
	now := w.clock.at(in.Now)
	var out linOutput
	var err error
	switch in.Kind {
	case kindClaim:
		var rec *idem.Record
		rec, out.Claimed, err = w.store.Claim(ctx, idem.ClaimRequest{
			Scope: w.scope, Key: key, Fingerprint: in.FP, Token: in.Token,
			Now: now, LeaseUntil: w.clock.at(in.Lease), ExpiresAt: w.clock.at(in.Expires),
		})
		if err == nil {
			out.Rec = w.observe(rec)
		}
	case kindComplete:
		err = w.store.Complete(ctx, w.scope, key, in.Token, responseFor(in.Resp), now, w.clock.at(in.Expires))
	case kindTxComplete:
		err = w.txComplete(ctx, in, key)
	case kindRelease:
		err = w.store.Release(ctx, w.scope, key, in.Token)
	case kindExtend:
		err = w.store.Extend(ctx, w.scope, key, in.Token, now, w.clock.at(in.Lease))
	case kindGet:
		var rec *idem.Record
		rec, err = w.store.Get(ctx, w.scope, key, now)
		if err == nil {
			out.Rec = w.observe(rec)
		}
	case kindDeleteExpired:
		out.N, err = w.store.DeleteExpired(ctx, now, in.Limit)
	}
	out.Result, out.Err = classify(err)
	return out
}

// txComplete is the transactional completion as one operation: BeginTx, the
// fenced completion inside the transaction, Commit (or Rollback on failure).
func (w *workload) txComplete(ctx context.Context, in linInput, key string) error {
	txCtx, tx, err := w.txStore.BeginTx(ctx)
	if err != nil {
		return fmt.Errorf("BeginTx: %w", stripSentinel(err))
	}
	if err := tx.Complete(txCtx, w.scope, key, in.Token, responseFor(in.Resp), w.clock.at(in.Now), w.clock.at(in.Expires)); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return err
	}
	if err := tx.Commit(txCtx); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return err
	}
	return nil
}

// stripSentinel keeps a BeginTx error from looking like a definite outcome.
func stripSentinel(err error) error { return errors.New(err.Error()) }
