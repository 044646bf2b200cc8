// Package checkertest provides small orders services for testing the checker:
// one correct (idem's middleware over memstore) and several with one deliberate
// idempotency flaw each. Every service answers
//
//	POST /orders            {"cart_id":"…","total_cents":1900} → 201, Location /orders/ord_N
//	GET  /orders?cart_id=…  → 200 {"orders":[…]} (the caller's tenant only)
//
// and requires "Authorization: Bearer <tenant>"; the tenant is the scope.
package checkertest

import (
	"bytes"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
)

// Work is how long creating an order takes (a payment call, say), so that
// racing requests overlap with the one that executes.
const Work = 20 * time.Millisecond

// Flaw selects how a service handles Idempotency-Key.
type Flaw int

// The services. All but Correct use a small hand-written idempotency layer that
// validates the key (400 when missing or over 255 characters) and has exactly
// the flaw named.
const (
	// Correct is idem.New(memstore.New(…), cfg) scoped by the bearer token.
	Correct Flaw = iota
	// CheckThenWrite looks the key up, pauses, then executes and stores: requests
	// racing with one key all execute.
	CheckThenWrite
	// NoFingerprint replays the first answer for any later body with the key.
	NoFingerprint
	// NoIdempotency executes every request with a key, new or used.
	NoIdempotency
	// RerenderedReplay re-encodes the stored JSON on replay: the same data, in
	// other bytes (members in another order).
	RerenderedReplay
	// SharedKeys keeps records per key only, not per tenant: a tenant sending
	// another's key gets the other's answer.
	SharedKeys
	// TruncatedKeys accepts keys of up to 1024 characters but keeps only their
	// first 255: keys that differ after that are one key.
	TruncatedKeys
	// HangupRollsBack binds the order's "transaction" to the request context
	// (and takes 10×Work to make an order):
	// when the client hangs up while the order is being made, the order is
	// rolled back and the key released, so the client's retry executes again
	// (what a SQL store does when its transaction follows the cancelled
	// context of a request whose client went away).
	HangupRollsBack
)

var flawNames = [...]string{"correct", "check_then_write", "no_fingerprint", "no_idempotency", "rerendered_replay", "shared_keys", "truncated_keys", "hangup_rolls_back"}

// String returns the flaw's snake_case name.
func (f Flaw) String() string {
	if int(f) < len(flawNames) {
		return flawNames[f]
	}
	return fmt.Sprintf("Flaw(%d)", int(f))
}

// Flaws lists every flaw but Correct.
var Flaws = []Flaw{CheckThenWrite, NoFingerprint, NoIdempotency, RerenderedReplay, SharedKeys, TruncatedKeys, HangupRollsBack}

// NewServer starts a service with the given flaw. Close it when done.
func NewServer(flaw Flaw) *httptest.Server {
	return httptest.NewServer(Handler(flaw))
}

// Handler returns the service with the given flaw, for callers that run their
// own server.
func Handler(flaw Flaw) http.Handler {
	work := Work
	if flaw == HangupRollsBack {
		// Long enough for the hang-up to fall well inside it on a loaded machine.
		work = 10 * Work
	}
	return SlowHandler(flaw, work)
}

// SlowHandler is Handler with orders that take work to make instead of Work.
func SlowHandler(flaw Flaw, work time.Duration) http.Handler {
	app := &orders{work: work, rollBackOnHangup: flaw == HangupRollsBack}
	var h http.Handler = app
	if flaw == Correct {
		mw, err := idem.New(memstore.New(&memstore.Config{JanitorInterval: -1}), &idem.Config{Lease: 5 * time.Second})
		if err != nil {
			panic(err) // the config is constant
		}
		h = mw(app)
	} else {
		h = &naive{flaw: flaw, next: app, recs: map[string]*record{}}
	}
	return auth(h)
}

// NewWaitingServer is the correct service with idem.Config.InFlightWait set: a
// duplicate of a running request waits for its outcome and gets the replay
// instead of 409.
func NewWaitingServer() *httptest.Server {
	app := &orders{work: Work}
	mw, err := idem.New(memstore.New(&memstore.Config{JanitorInterval: -1}), &idem.Config{Lease: 5 * time.Second, InFlightWait: time.Minute})
	if err != nil {
		panic(err) // the config is constant
	}
	return httptest.NewServer(auth(mw(app)))
}

// auth scopes each request to the tenant named by its bearer token.
func auth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tenant, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		if !ok || tenant == "" {
			w.Header().Set("WWW-Authenticate", "Bearer")
			http.Error(w, "send Authorization: Bearer <tenant>", http.StatusUnauthorized)
			return
		}
		next.ServeHTTP(w, r.WithContext(idem.WithScope(r.Context(), tenant)))
	})
}

type order struct {
	ID         string `json:"id"`
	CartID     string `json:"cart_id"`
	TotalCents int    `json:"total_cents"`
	CreatedAt  string `json:"created_at"`
	tenant     string
}

// orders is the business handler: no idempotency of its own.
type orders struct {
	// work is how long making an order takes.
	work time.Duration
	// rollBackOnHangup makes no order when the request's context ended while
	// the order was being made, as a transaction bound to it would.
	rollBackOnHangup bool

	mu   sync.Mutex
	next int
	list []order
}

func (o *orders) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	tenant := idem.ScopeFrom(r.Context())
	switch r.Method {
	case http.MethodPost:
		var in struct {
			CartID     string `json:"cart_id"`
			TotalCents int    `json:"total_cents"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.CartID == "" {
			http.Error(w, "send {\"cart_id\":\"…\",\"total_cents\":N}", http.StatusBadRequest)
			return
		}
		time.Sleep(o.work)
		if o.rollBackOnHangup && r.Context().Err() != nil {
			http.Error(w, "the request was cancelled; the order was rolled back", http.StatusServiceUnavailable)
			return
		}
		o.mu.Lock()
		o.next++
		ord := order{ID: fmt.Sprintf("ord_%d", o.next), CartID: in.CartID, TotalCents: in.TotalCents,
			CreatedAt: time.Now().UTC().Format(time.RFC3339Nano), tenant: tenant}
		o.list = append(o.list, ord)
		o.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/"+ord.ID)
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(ord)
	case http.MethodGet:
		cart := r.URL.Query().Get("cart_id")
		out := struct {
			Orders []order `json:"orders"`
		}{Orders: []order{}}
		o.mu.Lock()
		for _, ord := range o.list {
			if ord.tenant == tenant && (cart == "" || ord.CartID == cart) {
				out.Orders = append(out.Orders, ord)
			}
		}
		o.mu.Unlock()
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(out)
	default:
		w.Header().Set("Allow", "GET, POST")
		http.Error(w, "use GET or POST", http.StatusMethodNotAllowed)
	}
}

// record is the naive layer's stored outcome.
type record struct {
	fp     [32]byte
	done   bool
	status int
	header http.Header
	body   []byte
}

// naive is a hand-written idempotency layer with one flaw.
type naive struct {
	flaw Flaw
	next http.Handler
	mu   sync.Mutex
	recs map[string]*record
}

func (n *naive) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost {
		n.next.ServeHTTP(w, r)
		return
	}
	key := r.Header.Get("Idempotency-Key")
	maxKey := 255
	if n.flaw == TruncatedKeys {
		maxKey = 1024
	}
	if key == "" || len(key) > maxKey {
		problem(w, http.StatusBadRequest, fmt.Sprintf("send an Idempotency-Key of 1 to %d characters", maxKey))
		return
	}
	if n.flaw == TruncatedKeys && len(key) > 255 {
		key = key[:255] // the flaw: a key column of 255 characters
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		problem(w, http.StatusBadRequest, "unreadable body")
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	fp := sha256.Sum256(body)
	id := idem.ScopeFrom(r.Context()) + "\x00" + key
	if n.flaw == SharedKeys {
		id = key
	}
	switch n.flaw {
	case NoIdempotency:
		n.next.ServeHTTP(w, r)
		return
	case CheckThenWrite:
		n.mu.Lock()
		rec := n.recs[id]
		n.mu.Unlock()
		if rec != nil {
			n.answer(w, rec, fp)
			return
		}
		time.Sleep(100 * time.Millisecond) // the gap between check and write
		rec = n.execute(r, fp)
		n.mu.Lock()
		n.recs[id] = rec
		n.mu.Unlock()
		write(w, rec.status, rec.header, rec.body)
		return
	}
	n.mu.Lock()
	rec, found := n.recs[id]
	if !found {
		rec = &record{fp: fp}
		n.recs[id] = rec
	}
	n.mu.Unlock()
	if found {
		n.answer(w, rec, fp)
		return
	}
	done := n.execute(r, fp)
	if n.flaw == HangupRollsBack && r.Context().Err() != nil {
		// The flaw: the transaction followed the cancelled request context, so
		// nothing is kept and the key is free again.
		n.mu.Lock()
		delete(n.recs, id)
		n.mu.Unlock()
		return
	}
	n.mu.Lock()
	*rec = *done
	n.mu.Unlock()
	write(w, done.status, done.header, done.body)
}

// execute runs the business handler and returns its outcome as a record.
func (n *naive) execute(r *http.Request, fp [32]byte) *record {
	rr := httptest.NewRecorder()
	n.next.ServeHTTP(rr, r)
	return &record{fp: fp, done: true, status: rr.Code, header: rr.Header().Clone(), body: rr.Body.Bytes()}
}

// answer answers a request whose key has a record.
func (n *naive) answer(w http.ResponseWriter, rec *record, fp [32]byte) {
	n.mu.Lock()
	r := *rec
	n.mu.Unlock()
	if n.flaw != NoFingerprint && r.fp != fp {
		problem(w, http.StatusUnprocessableEntity, "this key was used with a different body")
		return
	}
	if !r.done {
		w.Header().Set("Retry-After", "1")
		problem(w, http.StatusConflict, "a request with this key is in progress")
		return
	}
	body := r.body
	if n.flaw == RerenderedReplay {
		var m map[string]any
		if json.Unmarshal(r.body, &m) == nil {
			body, _ = json.Marshal(m) // same data, members sorted: other bytes
		}
	}
	w.Header().Set("Idempotent-Replayed", "true")
	write(w, r.status, r.header, body)
}

func write(w http.ResponseWriter, status int, header http.Header, body []byte) {
	for k, v := range header {
		w.Header()[k] = v
	}
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

func problem(w http.ResponseWriter, status int, detail string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"title": http.StatusText(status), "status": status, "detail": detail})
}

// NewNoContentServer starts a correct service — idem's middleware over memstore,
// scoped by the bearer token — whose PATCH /orders/{id} answers 204 No Content:
// no body and nothing else that tells one execution from another, so only
// Idempotent-Replayed does. It counts the PATCH requests it executes. Close it
// when done.
func NewNoContentServer() (*httptest.Server, *atomic.Int64) {
	var executions atomic.Int64
	mw, err := idem.New(memstore.New(&memstore.Config{JanitorInterval: -1}), &idem.Config{Lease: 5 * time.Second})
	if err != nil {
		panic(err) // the config is constant
	}
	mux := http.NewServeMux()
	mux.Handle("PATCH /orders/{id}", mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		time.Sleep(Work)
		executions.Add(1)
		w.WriteHeader(http.StatusNoContent)
	})))
	return httptest.NewServer(auth(mux)), &executions
}
