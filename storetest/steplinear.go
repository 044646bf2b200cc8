package storetest

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
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

// The linearizability check of step records (idem.StepStore): many goroutines
// run random step operations — BeginStep (fenced on the request record or not,
// with Rerun or not), FinishStep, AbandonStep, GetSteps, SettleStep,
// DeleteExpiredSteps — mixed with the request record's Claim, Complete,
// Release and Get that move the fence, on a few keys with two step names each;
// porcupine checks the history against a sequential model of one key's record
// and its steps. Time is the logical clock of CheckLinearizability.
//
// RunStepLinearizability runs it against a store (Run's "Steps/Linearizable"
// does, with the default length); LinearizabilityEnv sets the length as for
// CheckLinearizability:
//
//	IDEM_LINEARIZABILITY_OPS=100000 go test -run 'TestConformance/Steps/Linearizable' ./sqlitestore/

// RunStepLinearizability runs CheckStepLinearizability against s and fails t
// with the counterexample when the history is not linearizable, and when a
// call failed with a store error although opts sets no Fault. opts may be nil.
func RunStepLinearizability(t *testing.T, s idem.Store, opts *LinearizabilityOptions) {
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
	res, err := CheckStepLinearizability(ctx, s, o)
	if err != nil {
		t.Fatalf("step linearizability check: %v", err)
	}
	t.Logf("step linearizability: %d operations in %d rounds (%d unknown outcomes) in %v; %v",
		res.Ops, res.Rounds, res.Unknown, res.Duration.Round(time.Millisecond), fmtCounts(res.Counts))
	for _, e := range res.UnknownErrors {
		t.Logf("an unknown outcome: %s", e)
	}
	if res.Unknown > 0 && o.Fault == nil {
		t.Errorf("%d of %d operations failed with a store error although no fault was injected, for example %q", res.Unknown, res.Ops, res.UnknownErrors)
	}
	if !res.Linearizable {
		t.Errorf("%s\nvisualisation: %s", res.Problem, res.Visualization)
	}
}

func testStepsLinearizable(t *testing.T, s idem.Store, _ idem.StepStore) {
	RunStepLinearizability(t, s, nil)
}

// CheckStepLinearizability runs the step workload against s, which must be an
// idem.StepStore, and checks its history. It returns an error only when the
// check could not run. The options are CheckLinearizability's (NoTx has no
// effect: the request records are claimed and completed outside transactions).
func CheckStepLinearizability(ctx context.Context, s idem.Store, o LinearizabilityOptions) (*LinearizabilityResult, error) {
	ss, ok := s.(idem.StepStore)
	if !ok {
		return nil, fmt.Errorf("%T is not an idem.StepStore", s)
	}
	if err := parseLinearizabilityEnv(&o); err != nil {
		return nil, err
	}
	if o.Ops <= 0 && o.Duration <= 0 {
		o.Ops = 500
	}
	if o.RoundOps <= 0 {
		o.RoundOps = 1000
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
	scope := "slin-" + strconv.FormatUint(rand.Uint64(), 36)
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
				break
			}
			return nil, err
		}
		w := &stepWorkload{store: s, steps: ss, opts: o, clock: clock, round: round, scope: scope}
		history := w.run(ctx, n, o.Seed+uint64(round))
		res.Rounds++
		res.Ops += n
		res.Unknown += int(w.unknown.Load())
		for _, e := range w.errs {
			if len(res.UnknownErrors) < 3 {
				res.UnknownErrors = append(res.UnknownErrors, e)
			}
		}
		for k, c := range w.kinds {
			res.Counts[k] += c
		}
		if w.problem != "" {
			res.Linearizable, res.Problem = false, fmt.Sprintf("round %d: %s", round, w.problem)
			break
		}
		model := stepLinModel()
		verdict, info := porcupine.CheckOperationsVerbose(model, history, o.CheckTimeout)
		if verdict == porcupine.Ok {
			continue
		}
		res.Linearizable = false
		if verdict == porcupine.Unknown {
			res.Problem = fmt.Sprintf("round %d (seed %d): porcupine's search timed out after %v on %d operations: linearizability was not proven; raise CheckTimeout or lower RoundOps",
				round, o.Seed+uint64(round), o.CheckTimeout, len(history))
		} else {
			res.Problem = fmt.Sprintf("round %d (seed %d): the history of %d step operations is NOT linearizable.\n%s",
				round, o.Seed+uint64(round), len(history), stepCounterexample(model, history, o.CheckTimeout))
		}
		res.Visualization = writeVisualization(model, info)
		break
	}
	res.Duration = time.Since(start)
	return res, nil
}

// stepNames are the two step names of every key.
var stepNames = [2]string{"charge", "ship:x"}

// sKind names a step workload operation.
type sKind uint8

const (
	skRecord sKind = iota + 1 // a request record operation (Rec.Kind)
	skBegin
	skFinish
	skAbandon
	skGetSteps
	skSettle
	skDeleteExpiredSteps
)

func (k sKind) String() string {
	return [...]string{"?", "record", "BeginStep", "FinishStep", "AbandonStep", "GetSteps", "SettleStep", "DeleteExpiredSteps"}[k]
}

// sStep is one step record as the model keeps it and a store returned it;
// the zero value is the absent record.
type sStep struct {
	Present bool
	State   idem.StepState
	Owner   string // compared only while started
	Derived string
	Result  string // compared only once done or failed
	Started int64
	Expires int64
	Ident   string // scope, key and name the store named; observations only
}

func (r sStep) live(now int64) bool { return r.Present && r.Expires > now }

func (r sStep) sameAs(obs sStep, ident string) bool {
	want := r
	want.Ident = ident
	if want.State != idem.StepStarted {
		want.Owner, obs.Owner = "", ""
	} else {
		want.Result, obs.Result = "", ""
	}
	return want == obs
}

// sState is the model's state of one key: its request record and steps.
type sState struct {
	Rec   linRecord
	Steps [2]sStep
}

type sInput struct {
	Kind    sKind
	Key     int // -1: DeleteExpiredSteps (every key)
	Name    int
	Ident   string // scope, key and name
	Rec     linInput
	Now     int64
	Horizon int64
	Owner   string
	Holder  bool
	Rerun   bool
	Derived string
	Expires int64
	State   idem.StepState // FinishStep, SettleStep (0: delete)
	Result  string
	Limit   int
}

type sOutput struct {
	Result linResult
	Err    string
	Rec    linOutput
	Began  bool
	Step   sStep    // BeginStep
	Steps  [2]sStep // GetSteps, by name
	Bad    string   // an observation no model state allows (a foreign name, a duplicate)
	N      int
}

// sStep returns every state after the operation; none when its output is
// impossible. Expired step records and an expired request record may vanish at
// any moment before it.
func sStepFn(state, input, output interface{}) []interface{} {
	s := state.(sState)
	in := input.(sInput)
	out := output.(sOutput)
	if out.Bad != "" {
		return nil
	}
	befores := []sState{s}
	if s.Rec.Present && s.Rec.Expires <= in.Horizon {
		b := s
		b.Rec = linRecord{}
		befores = append(befores, b)
	}
	for i := range s.Steps {
		if s.Steps[i].Present && s.Steps[i].Expires <= in.Horizon {
			for _, b := range befores {
				b.Steps[i] = sStep{}
				befores = append(befores, b)
			}
		}
	}
	var next []interface{}
	for _, b := range befores {
		for _, n := range sApply(b, in, out) {
			next = append(next, n)
		}
	}
	return next
}

func sApply(s sState, in sInput, out sOutput) []sState {
	unknown := out.Result == resUnknown
	if in.Kind == skRecord {
		var next []sState
		for _, r := range apply(s.Rec, in.Rec, out.Rec) {
			n := s
			n.Rec = r
			next = append(next, n)
		}
		return next
	}
	if in.Kind == skDeleteExpiredSteps {
		if !unknown && out.Result != resOK {
			return nil
		}
		states := []sState{s}
		for i := range s.Steps {
			if s.Steps[i].Present && s.Steps[i].Expires <= in.Now {
				for _, b := range states {
					b.Steps[i] = sStep{}
					states = append(states, b)
				}
			}
		}
		return states
	}
	st := s.Steps[in.Name]
	switch in.Kind {
	case skBegin:
		if in.Holder && !(s.Rec.Present && s.Rec.State == idem.StateInFlight && s.Rec.Token == in.Owner && s.Rec.Expires > in.Now) {
			if unknown || out.Result == resLockLost {
				return []sState{s}
			}
			return nil
		}
		n := st
		began := false
		if !st.live(in.Now) {
			n = sStep{Present: true, State: idem.StepStarted, Owner: in.Owner, Derived: in.Derived, Started: in.Now, Expires: in.Expires}
			began = true
		} else {
			n.Expires = max(n.Expires, in.Expires)
			began = st.State == idem.StepStarted && st.Owner != in.Owner && (st.Owner == "" || in.Rerun)
			if began {
				n.Owner = in.Owner
			}
		}
		ns := s
		ns.Steps[in.Name] = n
		if unknown {
			return []sState{s, ns}
		}
		if out.Result == resOK && out.Began == began && n.sameAs(out.Step, in.Ident+"\x00"+stepNames[in.Name]) {
			return []sState{ns}
		}
		return nil
	case skFinish, skAbandon:
		owned := st.live(in.Now) && st.State == idem.StepStarted && in.Owner != "" && st.Owner == in.Owner
		if !owned {
			if unknown || out.Result == resLockLost {
				return []sState{s}
			}
			return nil
		}
		n := st
		if in.Kind == skFinish {
			n.State, n.Result = in.State, in.Result
		} else {
			n.Owner = ""
		}
		ns := s
		ns.Steps[in.Name] = n
		if unknown {
			return []sState{s, ns}
		}
		if out.Result == resOK {
			return []sState{ns}
		}
		return nil
	case skSettle:
		if !st.live(in.Now) {
			if unknown || out.Result == resNotFound {
				return []sState{s}
			}
			return nil
		}
		n := sStep{}
		if in.State != 0 {
			n = st
			n.State, n.Result, n.Owner = in.State, in.Result, ""
		}
		ns := s
		ns.Steps[in.Name] = n
		if unknown {
			return []sState{s, ns}
		}
		if out.Result == resOK {
			return []sState{ns}
		}
		return nil
	case skGetSteps:
		if out.Result != resOK {
			return nil
		}
		for i := range s.Steps {
			m := s.Steps[i]
			if m.live(in.Now) {
				if !m.sameAs(out.Steps[i], in.Ident+"\x00"+stepNames[i]) {
					return nil
				}
			} else if out.Steps[i].Present {
				return nil
			}
		}
		return []sState{s}
	}
	return nil
}

func describeStep(r sStep) string {
	if !r.Present {
		return "absent"
	}
	s := fmt.Sprintf("%v derived=%s started=%s expires=%s", r.State, r.Derived, fmtMs(r.Started), fmtMs(r.Expires))
	if r.State == idem.StepStarted {
		s += fmt.Sprintf(" owner=%q", r.Owner)
	} else {
		s += " result=" + r.Result
	}
	return s
}

func describeSState(st interface{}) string {
	s := st.(sState)
	return fmt.Sprintf("record: %s; %s: %s; %s: %s", describeRecord(s.Rec), stepNames[0], describeStep(s.Steps[0]), stepNames[1], describeStep(s.Steps[1]))
}

func describeSOp(input, output interface{}) string {
	in := input.(sInput)
	out := output.(sOutput)
	if in.Kind == skRecord {
		return describeOp(in.Rec, out.Rec)
	}
	var call string
	name := ""
	if in.Kind != skDeleteExpiredSteps {
		name = stepNames[in.Name]
	}
	switch in.Kind {
	case skBegin:
		call = fmt.Sprintf("BeginStep(k%d %s owner=%s holder=%v rerun=%v derived=%s now=%s expires=%s)", in.Key, name, in.Owner, in.Holder, in.Rerun, in.Derived, fmtMs(in.Now), fmtMs(in.Expires))
	case skFinish:
		call = fmt.Sprintf("FinishStep(k%d %s owner=%s %v %s now=%s)", in.Key, name, in.Owner, in.State, in.Result, fmtMs(in.Now))
	case skAbandon:
		call = fmt.Sprintf("AbandonStep(k%d %s owner=%s now=%s)", in.Key, name, in.Owner, fmtMs(in.Now))
	case skSettle:
		call = fmt.Sprintf("SettleStep(k%d %s %v %s now=%s)", in.Key, name, in.State, in.Result, fmtMs(in.Now))
	case skGetSteps:
		call = fmt.Sprintf("GetSteps(k%d now=%s)", in.Key, fmtMs(in.Now))
	case skDeleteExpiredSteps:
		call = fmt.Sprintf("DeleteExpiredSteps(now=%s limit=%d)", fmtMs(in.Now), in.Limit)
	}
	var res string
	switch {
	case out.Bad != "":
		res = "impossible: " + out.Bad
	case out.Result == resUnknown:
		res = "unknown (" + out.Err + ")"
	case in.Kind == skBegin && out.Result == resOK:
		res = fmt.Sprintf("began=%v %s", out.Began, describeStep(out.Step))
	case in.Kind == skGetSteps && out.Result == resOK:
		res = fmt.Sprintf("%s: %s; %s: %s", stepNames[0], describeStep(out.Steps[0]), stepNames[1], describeStep(out.Steps[1]))
	case in.Kind == skDeleteExpiredSteps && out.Result == resOK:
		res = fmt.Sprintf("%d deleted", out.N)
	default:
		res = out.Result.String()
	}
	return call + " → " + res
}

func sPartition(history []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[int][]porcupine.Operation{}
	var all []porcupine.Operation
	for _, op := range history {
		if k := op.Input.(sInput).Key; k >= 0 {
			byKey[k] = append(byKey[k], op)
		} else {
			all = append(all, op)
		}
	}
	keys := make([]int, 0, len(byKey))
	for k := range byKey {
		keys = append(keys, k)
	}
	sort.Ints(keys)
	var parts [][]porcupine.Operation
	for _, k := range keys {
		p := append(byKey[k], all...)
		sort.SliceStable(p, func(i, j int) bool { return p[i].Call < p[j].Call })
		parts = append(parts, p)
	}
	if len(parts) == 0 && len(all) > 0 {
		parts = append(parts, all)
	}
	return parts
}

func stepLinModel() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition:         sPartition,
		Init:              func() []interface{} { return []interface{}{sState{}} },
		Step:              sStepFn,
		Equal:             func(a, b interface{}) bool { return a.(sState) == b.(sState) },
		DescribeOperation: describeSOp,
		DescribeState:     describeSState,
	}
	return nm.ToModel()
}

// stepCounterexample describes the first key whose history is not
// linearizable: the last steps of its longest linearizable prefix and the
// operations that cannot follow it.
func stepCounterexample(model porcupine.Model, history []porcupine.Operation, timeout time.Duration) string {
	single := model
	single.Partition, single.PartitionEvent = nil, nil
	for _, part := range sPartition(history) {
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
		fmt.Fprintf(&b, "%d operations; the longest linearizable prefix has %d. Its last steps:\n", len(part), len(longest))
		state := model.Init()
		done := map[[2]int64]bool{}
		for i, op := range longest {
			_, state = model.Step(state, op.Input, op.Output)
			done[[2]int64{op.Call, int64(op.ClientId)}] = true
			if i >= len(longest)-6 {
				fmt.Fprintf(&b, "  client %d: %s\n      state after: %s\n", op.ClientId, describeSOp(op.Input, op.Output), model.DescribeState(state))
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
					fmt.Fprintf(&b, "  client %d: %s\n", op.ClientId, describeSOp(op.Input, op.Output))
				}
			}
		}
		return b.String()
	}
	return "(no single key's history is illegal on its own: see the visualisation)"
}

// stepWorkload is one round of the step check.
type stepWorkload struct {
	store idem.Store
	steps idem.StepStore
	opts  LinearizabilityOptions
	clock *logicalClock
	round int
	scope string
	start time.Time

	mu      sync.Mutex
	tokens  [][]string    // per key: claim tokens
	owners  [][2][]string // per key and name: owners of BeginSteps
	history []porcupine.Operation
	kinds   map[string]int
	errs    []string
	problem string // what the model cannot see (GetSteps' order, DeleteExpiredSteps' counts)
	seq     atomic.Int64
	unknown atomic.Int64
}

func (w *stepWorkload) keyName(k int) string { return fmt.Sprintf("r%d-k%d", w.round, k) }

func (w *stepWorkload) ts() int64 { return time.Since(w.start).Nanoseconds() }

func (w *stepWorkload) run(ctx context.Context, n int, seed uint64) []porcupine.Operation {
	w.start = time.Now()
	w.tokens = make([][]string, w.opts.Keys)
	w.owners = make([][2][]string, w.opts.Keys)
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
		if w.history[i].Output.(sOutput).Result == resUnknown {
			w.history[i].Return = end
			in := w.history[i].Input.(sInput)
			in.Horizon = horizon
			w.history[i].Input = in
		}
	}
	return w.history
}

// pick returns one of list: mostly the latest, sometimes an older one, or
// alt.
func pick(rng *rand.Rand, list []string, alt string) string {
	switch r := rng.IntN(10); {
	case len(list) == 0 || r == 0:
		return alt
	case r < 7:
		return list[len(list)-1]
	default:
		return list[rng.IntN(len(list))]
	}
}

func (w *stepWorkload) advance(rng *rand.Rand) {
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

func (w *stepWorkload) one(ctx context.Context, rng *rand.Rand, client int) {
	if rng.IntN(100) < 5 {
		w.advance(rng)
	}
	k := rng.IntN(w.opts.Keys)
	key := w.keyName(k)
	name := rng.IntN(len(stepNames))
	seq := w.seq.Add(1)
	in := sInput{Key: k, Name: name, Ident: w.scope + "\x00" + key}
	w.mu.Lock()
	tokens := append([]string(nil), w.tokens[k]...)
	owners := append([]string(nil), w.owners[k][name]...)
	w.mu.Unlock()
	ttl := []int64{linTTLShort, linTTLLong}[rng.IntN(2)]
	switch r := rng.IntN(100); {
	case r < 14:
		in.Kind = skRecord
		in.Rec = linInput{Key: k, Ident: in.Ident, Kind: kindClaim, FP: "v2:s", Token: fmt.Sprintf("t%d", seq)}
	case r < 18:
		in.Kind = skRecord
		in.Rec = linInput{Key: k, Ident: in.Ident, Kind: kindComplete, Token: pick(rng, tokens, "never-claimed"), Resp: fmt.Sprint(seq)}
	case r < 21:
		in.Kind = skRecord
		in.Rec = linInput{Key: k, Ident: in.Ident, Kind: kindRelease, Token: pick(rng, tokens, "never-claimed")}
	case r < 50:
		in.Kind = skBegin
		in.Holder, in.Rerun = rng.IntN(2) == 0, rng.IntN(2) == 0
		in.Owner = pick(rng, tokens, fmt.Sprintf("o%d", seq))
		if !in.Holder && rng.IntN(3) == 0 {
			in.Owner = fmt.Sprintf("o%d", seq) // a single-transaction execution's own token
		}
		in.Derived = fmt.Sprintf("d%d", seq)
	case r < 66:
		in.Kind = skFinish
		in.Owner = pick(rng, owners, pick(rng, tokens, ""))
		in.State = []idem.StepState{idem.StepDone, idem.StepFailed}[rng.IntN(2)]
		in.Result = fmt.Sprintf(`{"r":%d}`, seq)
	case r < 74:
		in.Kind = skAbandon
		in.Owner = pick(rng, owners, "o-none")
	case r < 90:
		in.Kind = skGetSteps
	case r < 96:
		in.Kind = skSettle
		in.State = []idem.StepState{0, idem.StepDone, idem.StepFailed}[rng.IntN(3)]
		in.Result = fmt.Sprintf(`{"settled":%d}`, seq)
	default:
		in.Kind, in.Key, in.Ident, in.Limit = skDeleteExpiredSteps, -1, "", linLimit
	}
	call := w.ts()
	in.Now = w.clock.now()
	in.Expires = in.Now + ttl
	if in.Kind == skRecord {
		in.Rec.Now = in.Now
		in.Rec.Lease = in.Now + []int64{linLeaseShort, linLeaseLong}[rng.IntN(2)]
		in.Rec.Expires = max(in.Now+ttl, in.Rec.Lease)
	}
	out := w.do(ctx, in, key)
	ret := w.ts()
	in.Horizon = w.clock.now() + 1
	in.Rec.Horizon = in.Horizon
	if out.Result == resUnknown {
		w.unknown.Add(1)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	kind := in.Kind.String()
	if in.Kind == skRecord {
		kind = in.Rec.Kind.String()
		if in.Rec.Kind == kindClaim && (out.Rec.Claimed || out.Result == resUnknown) {
			w.tokens[k] = append(w.tokens[k], in.Rec.Token)
		}
	}
	if in.Kind == skBegin && (out.Began || out.Result == resUnknown) {
		w.owners[k][name] = append(w.owners[k][name], in.Owner)
	}
	w.kinds[kind]++
	if out.Result == resUnknown && len(w.errs) < 3 {
		w.errs = append(w.errs, kind+": "+out.Err)
	}
	if out.Result == resUnknown && (in.Kind == skGetSteps || (in.Kind == skRecord && in.Rec.Kind == kindGet)) {
		return
	}
	w.history = append(w.history, porcupine.Operation{ClientId: client, Input: in, Call: call, Output: out, Return: ret})
}

func (w *stepWorkload) observe(r *idem.StepRecord) sStep {
	if r == nil {
		return sStep{Ident: "<nil record>"}
	}
	base := w.clock.base.UnixMilli()
	return sStep{
		Present: true, State: r.State, Owner: r.Owner, Derived: r.DerivedKey, Result: string(r.Result),
		Started: r.StartedAt.UnixMilli() - base, Expires: r.ExpiresAt.UnixMilli() - base,
		Ident: r.Scope + "\x00" + r.Key + "\x00" + r.Name,
	}
}

func (w *stepWorkload) do(ctx context.Context, in sInput, key string) sOutput {
	ctx, cancel := context.WithTimeout(ctx, w.opts.CallTimeout)
	defer cancel()
	now := w.clock.at(in.Now)
	var out sOutput
	var err error
	name := stepNames[in.Name]
	switch in.Kind {
	case skRecord:
		lw := &workload{store: w.store, opts: w.opts, clock: w.clock, scope: w.scope}
		out.Rec = lw.do(ctx, in.Rec, key)
		out.Result, out.Err = out.Rec.Result, out.Rec.Err
		return out
	case skBegin:
		var rec *idem.StepRecord
		rec, out.Began, err = w.steps.BeginStep(ctx, idem.BeginStepRequest{
			Scope: w.scope, Key: key, Name: name, Owner: in.Owner, Holder: in.Holder, Rerun: in.Rerun,
			DerivedKey: in.Derived, Now: now, ExpiresAt: w.clock.at(in.Expires),
		})
		if err == nil {
			out.Step = w.observe(rec)
		}
	case skFinish:
		err = w.steps.FinishStep(ctx, w.scope, key, name, in.Owner, in.State, []byte(in.Result), now)
	case skAbandon:
		err = w.steps.AbandonStep(ctx, w.scope, key, name, in.Owner, now)
	case skSettle:
		err = w.steps.SettleStep(ctx, w.scope, key, name, in.State, []byte(in.Result), now)
	case skGetSteps:
		var recs []idem.StepRecord
		recs, err = w.steps.GetSteps(ctx, w.scope, key, now)
		for i := range recs {
			if i > 0 && recs[i].StartedAt.Before(recs[i-1].StartedAt) {
				w.mu.Lock()
				if w.problem == "" {
					w.problem = fmt.Sprintf("GetSteps(%s) returned %q (started %v) after %q (started %v): not ordered by StartedAt", key, recs[i].Name, recs[i].StartedAt, recs[i-1].Name, recs[i-1].StartedAt)
				}
				w.mu.Unlock()
			}
			idx := -1
			for j, n := range stepNames {
				if recs[i].Name == n {
					idx = j
				}
			}
			switch {
			case idx < 0:
				out.Bad = fmt.Sprintf("a step named %q", recs[i].Name)
			case out.Steps[idx].Present:
				out.Bad = fmt.Sprintf("step %q twice", recs[i].Name)
			default:
				out.Steps[idx] = w.observe(&recs[i])
			}
		}
	case skDeleteExpiredSteps:
		out.N, err = w.steps.DeleteExpiredSteps(ctx, now, in.Limit)
		if err == nil {
			// Each round has opts.Keys keys of two steps, and earlier rounds theirs.
			max := (w.round + 1) * w.opts.Keys * len(stepNames)
			if out.N < 0 || out.N > in.Limit || out.N > max {
				w.mu.Lock()
				if w.problem == "" {
					w.problem = fmt.Sprintf("DeleteExpiredSteps(limit %d) reported %d deleted records; the store has held at most %d", in.Limit, out.N, max)
				}
				w.mu.Unlock()
			}
		}
	}
	out.Result, out.Err = classify(err)
	if errors.Is(err, idem.ErrNotFound) && in.Kind != skSettle {
		out.Result, out.Err = resUnknown, err.Error()
	}
	return out
}
