package storetest

import (
	"fmt"
	"net/http"
	"sort"
	"strings"

	"github.com/anishathalye/porcupine"
	"github.com/idemkit/idem"
)

// The sequential model of one record, used by the linearizability check.
//
// Times are whole milliseconds since the logical clock's base, so that the model
// computes every decision exactly and stores that keep milliseconds lose nothing.

// linKind names an operation of the workload.
type linKind uint8

const (
	kindClaim linKind = iota + 1
	kindComplete
	kindTxComplete // BeginTx → Tx.Complete → Tx.Commit, one operation
	kindRelease
	kindExtend
	kindGet
	kindDeleteExpired
)

func (k linKind) String() string {
	switch k {
	case kindClaim:
		return "Claim"
	case kindComplete:
		return "Complete"
	case kindTxComplete:
		return "TxComplete"
	case kindRelease:
		return "Release"
	case kindExtend:
		return "Extend"
	case kindGet:
		return "Get"
	case kindDeleteExpired:
		return "DeleteExpired"
	}
	return "?"
}

// linRecord is one record as the model keeps it, and as a store returned it.
// The zero value is the absent record. It is comparable with ==.
type linRecord struct {
	Present bool
	State   idem.State
	FP      string
	Token   string // compared only while in flight
	Created int64
	Lease   int64 // compared only while in flight
	Expires int64
	Resp    string // canonical form of the stored response; "" while in flight
	Ident   string // scope and key the store named; set on observations only
}

// linInput is the input of one operation.
type linInput struct {
	Kind    linKind
	Key     int // index of the key in the round; -1 for DeleteExpired (every key)
	Ident   string
	Now     int64 // the now passed to the store
	Horizon int64 // the logical clock when the call returned (or the end of the history)
	FP      string
	Token   string
	Lease   int64 // Claim, Extend: the lease deadline
	Expires int64 // Claim, Complete: the expiry
	Resp    string
	Limit   int
}

// linResult is how an operation ended.
type linResult uint8

const (
	resOK       linResult = iota + 1
	resLockLost           // idem.ErrLockLost: definite, nothing changed
	resNotFound           // idem.ErrNotFound
	resAborted            // idem.ErrTxAborted: definite, nothing committed
	resRefused            // idem.ErrFieldTooLarge: definite, nothing changed
	resUnknown            // any other error: it may or may not have taken effect
)

func (r linResult) String() string {
	switch r {
	case resOK:
		return "ok"
	case resLockLost:
		return "ErrLockLost"
	case resNotFound:
		return "ErrNotFound"
	case resAborted:
		return "ErrTxAborted"
	case resRefused:
		return "ErrFieldTooLarge"
	case resUnknown:
		return "unknown"
	}
	return "?"
}

// linOutput is the output of one operation.
type linOutput struct {
	Result  linResult
	Claimed bool
	Rec     linRecord // Claim and Get: the record returned
	N       int       // DeleteExpired: how many it reported
	Err     string    // the error of an unknown outcome, for the report
}

// canonicalResponse is the exact form in which the model compares responses.
func canonicalResponse(r *idem.Response) string {
	if r == nil {
		return "<nil>"
	}
	names := make([]string, 0, len(r.Header))
	for n := range r.Header {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	fmt.Fprintf(&b, "%d", r.Status)
	for _, n := range names {
		fmt.Fprintf(&b, " %s=%q", n, r.Header[n])
	}
	fmt.Fprintf(&b, " body=%q omitted=%v ref=%q", r.Body, r.BodyOmitted, r.Ref)
	return b.String()
}

// responseFor is the response the workload completes with under id.
//
// An id starting with "big" has a Ref of bigRef bytes, more than some stores
// keep (a MySQL BLOB): the store keeps it exactly or refuses it with
// idem.ErrFieldTooLarge, changing nothing.
func responseFor(id string) *idem.Response {
	ref := "ref-" + id
	if strings.HasPrefix(id, "big") {
		ref += strings.Repeat("r", bigRef)
	}
	return &idem.Response{
		Status: 201,
		Header: http.Header{"Location": {"/r/" + id}},
		Body:   []byte("body-" + id),
		Ref:    ref,
	}
}

// bigRef is the size of the Ref of a "big" response.
const bigRef = 70_000

// live reports whether the record counts at now (present and not expired).
func (r linRecord) live(now int64) bool { return r.Present && r.Expires > now }

// heldBy reports whether the record is in flight under token. Expiry plays no
// part: the fence compares the stored record, and an expired one that is still
// stored may be completed, released or extended by its holder.
func (r linRecord) heldBy(token string) bool {
	return r.Present && r.State == idem.StateInFlight && r.Token == token
}

// sameAs compares an observed record with the model's (the lease and the token
// only while in flight: a complete record's lease means nothing, and a store
// may drop its token, which fences nothing any more).
func (r linRecord) sameAs(obs linRecord, ident string) bool {
	want := r
	want.Ident = ident
	if want.State != idem.StateInFlight {
		want.Lease, obs.Lease = 0, 0
		want.Token, obs.Token = "", ""
	}
	return want == obs
}

// linStep returns every state the record can be in after the operation, given
// its output; none when the output is impossible. Expired records may vanish at
// any moment (a janitor, or the backend's own expiry, deletes them): before the
// operation, a record expired by the logical clock at its return may be absent.
func linStep(state interface{}, input interface{}, output interface{}) []interface{} {
	s := state.(linRecord)
	in := input.(linInput)
	out := output.(linOutput)
	before := []linRecord{s}
	if s.Present && s.Expires <= in.Horizon {
		before = append(before, linRecord{})
	}
	var next []interface{}
	for _, b := range before {
		for _, n := range apply(b, in, out) {
			next = append(next, n)
		}
	}
	return next
}

// apply is one operation on one state.
func apply(s linRecord, in linInput, out linOutput) []linRecord {
	unknown := out.Result == resUnknown
	if out.Result == resRefused {
		// Only an oversized response may be refused, and then nothing changed.
		if (in.Kind == kindComplete || in.Kind == kindTxComplete) && strings.HasPrefix(in.Resp, "big") {
			return []linRecord{s}
		}
		return nil
	}
	if out.Result == resAborted {
		// Nothing committed; only the transactional completion may report it.
		if in.Kind == kindTxComplete {
			return []linRecord{s}
		}
		return nil
	}
	switch in.Kind {
	case kindClaim:
		created := in.Now
		claimed := !s.live(in.Now)
		if !claimed && s.State == idem.StateInFlight && s.Lease <= in.Now && s.FP == in.FP {
			claimed, created = true, s.Created
		}
		if !claimed {
			if unknown || (out.Result == resOK && !out.Claimed && s.sameAs(out.Rec, in.Ident)) {
				return []linRecord{s}
			}
			return nil
		}
		n := linRecord{Present: true, State: idem.StateInFlight, FP: in.FP, Token: in.Token,
			Created: created, Lease: in.Lease, Expires: in.Expires}
		if unknown || (out.Result == resOK && out.Claimed && n.sameAs(out.Rec, in.Ident)) {
			return []linRecord{n}
		}
		return nil
	case kindComplete, kindTxComplete, kindRelease, kindExtend:
		if !s.heldBy(in.Token) {
			if unknown || out.Result == resLockLost {
				return []linRecord{s}
			}
			return nil
		}
		if !unknown && out.Result != resOK {
			return nil
		}
		n := s
		switch in.Kind {
		case kindRelease:
			n = linRecord{}
		case kindExtend:
			n.Lease = in.Lease
			n.Expires = max(n.Expires, in.Lease)
		default:
			n.State, n.Expires, n.Resp = idem.StateComplete, in.Expires, canonicalResponse(responseFor(in.Resp))
		}
		return []linRecord{n}
	case kindGet:
		if s.live(in.Now) {
			if out.Result == resOK && s.sameAs(out.Rec, in.Ident) {
				return []linRecord{s}
			}
			return nil
		}
		if out.Result == resNotFound {
			return []linRecord{s}
		}
		return nil
	case kindDeleteExpired:
		// At most limit records go, and which is up to the store (SKIP LOCKED may
		// pass over a locked one): an expired record may or may not be deleted; a
		// live one never is. The count is checked across keys by the driver.
		if !unknown && out.Result != resOK {
			return nil
		}
		if s.Present && s.Expires <= in.Now {
			return []linRecord{s, {}}
		}
		return []linRecord{s}
	}
	return nil
}

// linPartition splits a history by key; DeleteExpired touches every key and
// joins every partition.
func linPartition(history []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[int][]porcupine.Operation{}
	var all []porcupine.Operation
	for _, op := range history {
		if k := op.Input.(linInput).Key; k >= 0 {
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

func fmtMs(ms int64) string { return fmt.Sprintf("%+.3fs", float64(ms)/1000) }

func describeRecord(r linRecord) string {
	if !r.Present {
		return "absent"
	}
	s := fmt.Sprintf("%v fp=%s tok=%s created=%s", r.State, r.FP, r.Token, fmtMs(r.Created))
	if r.State == idem.StateInFlight {
		s += " lease=" + fmtMs(r.Lease)
	}
	s += " expires=" + fmtMs(r.Expires)
	if r.Resp != "" {
		s += " resp=" + r.Resp
	}
	return s
}

// describeObserved describes a record a store returned, naming its scope and
// key only when they are not the ones asked for.
func describeObserved(r linRecord, ident string) string {
	s := describeRecord(r)
	if r.Ident != ident {
		s += fmt.Sprintf(" (scope and key %q, want %q)", r.Ident, ident)
	}
	return s
}

func describeOp(input, output interface{}) string {
	in := input.(linInput)
	out := output.(linOutput)
	var call string
	switch in.Kind {
	case kindClaim:
		call = fmt.Sprintf("Claim(k%d fp=%s tok=%s now=%s lease=%s expires=%s)", in.Key, in.FP, in.Token, fmtMs(in.Now), fmtMs(in.Lease), fmtMs(in.Expires))
	case kindComplete, kindTxComplete:
		call = fmt.Sprintf("%v(k%d tok=%s now=%s expires=%s resp=%s)", in.Kind, in.Key, in.Token, fmtMs(in.Now), fmtMs(in.Expires), in.Resp)
	case kindRelease:
		call = fmt.Sprintf("Release(k%d tok=%s)", in.Key, in.Token)
	case kindExtend:
		call = fmt.Sprintf("Extend(k%d tok=%s now=%s lease=%s)", in.Key, in.Token, fmtMs(in.Now), fmtMs(in.Lease))
	case kindGet:
		call = fmt.Sprintf("Get(k%d now=%s)", in.Key, fmtMs(in.Now))
	case kindDeleteExpired:
		call = fmt.Sprintf("DeleteExpired(now=%s limit=%d)", fmtMs(in.Now), in.Limit)
	}
	var res string
	switch {
	case out.Result == resUnknown:
		res = "unknown (" + out.Err + ")"
	case in.Kind == kindClaim && out.Claimed:
		res = "claimed " + describeObserved(out.Rec, in.Ident)
	case in.Kind == kindClaim:
		res = "not claimed: " + describeObserved(out.Rec, in.Ident)
	case in.Kind == kindGet && out.Result == resOK:
		res = describeObserved(out.Rec, in.Ident)
	case in.Kind == kindDeleteExpired && out.Result == resOK:
		res = fmt.Sprintf("%d deleted", out.N)
	default:
		res = out.Result.String()
	}
	return call + " → " + res
}

// linModel is the model of one record, partitioned by key.
func linModel() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition:         linPartition,
		Init:              func() []interface{} { return []interface{}{linRecord{}} },
		Step:              linStep,
		Equal:             func(a, b interface{}) bool { return a.(linRecord) == b.(linRecord) },
		DescribeOperation: describeOp,
		DescribeState:     func(s interface{}) string { return describeRecord(s.(linRecord)) },
	}
	return nm.ToModel()
}
