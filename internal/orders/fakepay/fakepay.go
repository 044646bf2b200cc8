// Package fakepay is a fake payment provider for tests of the reference
// service's charges (idem demo --payment-url): a real HTTP server on a loopback
// port that answers POST /charges as a payment API does, counts every call and
// every charge, and can be told to hold a call at a chosen point (so that a
// test can kill its client there), to answer slowly, or to fail.
//
// A charge is POST /charges with the JSON body {"amount_cents": N, "cart_id":
// "…"} and an Idempotency-Key header; the answer is 201 {"id": "ch_…",
// "amount_cents": N, "cart_id": "…"}.
//
// In HonoursKeys mode the provider behaves as Stripe does: a second call with a
// key it has charged for replays the first answer without charging again; one
// with the same key and another body is refused with 422; one that arrives while
// the first call with its key is still being handled gets 409. In IgnoresKeys
// mode every call charges.
//
// It is for tests only: nothing is persisted, and a Provider lives in the test
// process.
package fakepay

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"time"
)

// Mode says whether the provider honours Idempotency-Key.
type Mode int

const (
	// HonoursKeys replays a key's first answer (Stripe, Adyen, idem proxy).
	HonoursKeys Mode = iota
	// IgnoresKeys charges on every call.
	IgnoresKeys
)

// Point is where a held call waits.
type Point int

const (
	// BeforeCharge holds the call before the provider acts: if the client
	// goes away meanwhile, nothing is charged.
	BeforeCharge Point = iota + 1
	// AfterCharge holds the call after the charge is made, before the answer
	// is written: if the client goes away meanwhile, the answer is lost.
	AfterCharge
)

// Charge is one charge the provider made.
type Charge struct {
	ID          string
	Key         string // the Idempotency-Key it was made with ("" without)
	AmountCents int64
	CartID      string
	At          time.Time
}

// Call is one POST /charges the provider received.
type Call struct {
	Key  string
	Body string
	At   time.Time
}

// Provider is a running fake payment provider.
type Provider struct {
	// URL is the provider's base URL, http://127.0.0.1:PORT.
	URL string

	srv  *httptest.Server
	mode Mode

	mu      sync.Mutex
	calls   []Call
	charges []Charge
	keys    map[string]*keyed // HonoursKeys: key → first call's outcome
	fails   []int             // statuses to answer, in turn, without charging
	delay   time.Duration     // after the charge, before the answer
	written map[string]int    // cart_id → 201 answers written in full
	holds   []*Hold
}

type keyed struct {
	body   string
	done   bool // the answer below is final
	status int
	answer []byte
}

// Start starts a provider in mode on a loopback port. Close it when done.
func Start(mode Mode) *Provider {
	p := &Provider{mode: mode, keys: map[string]*keyed{}, written: map[string]int{}}
	p.srv = httptest.NewServer(http.HandlerFunc(p.serve))
	p.URL = p.srv.URL
	return p
}

// Close stops the provider, releasing every held call.
func (p *Provider) Close() {
	p.mu.Lock()
	for _, h := range p.holds {
		h.Release()
	}
	p.mu.Unlock()
	p.srv.CloseClientConnections()
	p.srv.Close()
}

// Hold is a call held at a Point.
type Hold struct {
	point    Point
	reached  chan struct{}
	released chan struct{}
	once     sync.Once
	relOnce  sync.Once
}

// Reached is closed when a call waits at the hold's point.
func (h *Hold) Reached() <-chan struct{} { return h.reached }

// Release lets the held call (or the next one to arrive) go on.
func (h *Hold) Release() { h.relOnce.Do(func() { close(h.released) }) }

// HoldNext makes the next call that reaches point wait there until Release,
// the client going away, or Close.
func (p *Provider) HoldNext(point Point) *Hold {
	h := &Hold{point: point, reached: make(chan struct{}), released: make(chan struct{})}
	p.mu.Lock()
	p.holds = append(p.holds, h)
	p.mu.Unlock()
	return h
}

// FailNext makes the next calls answer the given statuses, one each, without
// charging (for example 503, or 402 for a decline).
func (p *Provider) FailNext(statuses ...int) {
	p.mu.Lock()
	p.fails = append(p.fails, statuses...)
	p.mu.Unlock()
}

// SetDelay makes every call wait d after the charge, before answering.
func (p *Provider) SetDelay(d time.Duration) {
	p.mu.Lock()
	p.delay = d
	p.mu.Unlock()
}

// Calls returns the calls received so far.
func (p *Provider) Calls() []Call {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Call(nil), p.calls...)
}

// Charges returns the charges made so far.
func (p *Provider) Charges() []Charge {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Charge(nil), p.charges...)
}

// ChargesFor returns the charges made for cartID.
func (p *Provider) ChargesFor(cartID string) []Charge {
	var out []Charge
	for _, c := range p.Charges() {
		if c.CartID == cartID {
			out = append(out, c)
		}
	}
	return out
}

// CallsWith returns how many calls carried the Idempotency-Key key.
func (p *Provider) CallsWith(key string) int {
	n := 0
	for _, c := range p.Calls() {
		if c.Key == key {
			n++
		}
	}
	return n
}

// CallsFor returns the calls whose body names cartID.
func (p *Provider) CallsFor(cartID string) []Call {
	var out []Call
	for _, c := range p.Calls() {
		var b struct {
			CartID string `json:"cart_id"`
		}
		if json.Unmarshal([]byte(c.Body), &b) == nil && b.CartID == cartID {
			out = append(out, c)
		}
	}
	return out
}

// takeHold returns the first hold waiting for point, removing it.
func (p *Provider) takeHold(point Point) *Hold {
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, h := range p.holds {
		if h.point == point {
			p.holds = append(p.holds[:i], p.holds[i+1:]...)
			return h
		}
	}
	return nil
}

// wait blocks at point if a hold asks for it; it reports false when the
// client went away meanwhile.
func (p *Provider) wait(ctx context.Context, point Point) bool {
	h := p.takeHold(point)
	if h == nil {
		return true
	}
	h.once.Do(func() { close(h.reached) })
	select {
	case <-h.released:
		return true
	case <-ctx.Done():
		return false
	}
}

func (p *Provider) serve(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || r.URL.Path != "/charges" {
		answer(w, http.StatusNotFound, map[string]any{"error": map[string]string{"message": "no such route; POST /charges"}})
		return
	}
	raw, _ := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	key := r.Header.Get("Idempotency-Key")
	p.mu.Lock()
	p.calls = append(p.calls, Call{Key: key, Body: string(raw), At: time.Now()})
	var fail int
	if len(p.fails) > 0 {
		fail, p.fails = p.fails[0], p.fails[1:]
	}
	p.mu.Unlock()

	var req struct {
		AmountCents *int64 `json:"amount_cents"`
		CartID      string `json:"cart_id"`
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil || req.AmountCents == nil || req.CartID == "" || r.Header.Get("Content-Type") != "application/json" {
		answer(w, http.StatusBadRequest, map[string]any{"error": map[string]string{"type": "invalid_request_error", "message": fmt.Sprintf("send Content-Type: application/json and {\"amount_cents\": N, \"cart_id\": \"…\"} (%v)", err)}})
		return
	}

	var entry *keyed
	if p.mode == HonoursKeys && key != "" {
		p.mu.Lock()
		if e, ok := p.keys[key]; ok {
			p.mu.Unlock()
			switch {
			case e.body != string(raw):
				answer(w, http.StatusUnprocessableEntity, map[string]any{"error": map[string]string{"type": "idempotency_error", "message": "Keys for idempotent requests can only be used with the same parameters they were first used with."}})
			case !e.done:
				answer(w, http.StatusConflict, map[string]any{"error": map[string]string{"type": "idempotency_error", "message": "There is currently another in-progress request using this Idempotent Key; retry later."}})
			default:
				w.Header().Set("Idempotent-Replayed", "true")
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(e.status)
				_, _ = w.Write(e.answer)
			}
			return
		}
		entry = &keyed{body: string(raw)}
		p.keys[key] = entry
		p.mu.Unlock()
	}
	forget := func() { // the call did not act: a retry with the key starts afresh
		if entry != nil {
			p.mu.Lock()
			delete(p.keys, key)
			p.mu.Unlock()
		}
	}

	if fail != 0 {
		body, _ := json.Marshal(map[string]any{"error": map[string]string{"type": "card_error", "message": fmt.Sprintf("the fake provider was told to answer %d", fail)}})
		body = append(body, '\n')
		if fail < 500 && entry != nil { // a decline is the key's answer, replayed
			p.mu.Lock()
			entry.done, entry.status, entry.answer = true, fail, body
			p.mu.Unlock()
		} else {
			forget() // a 5xx did not act
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(fail)
		_, _ = w.Write(body)
		return
	}
	if !p.wait(r.Context(), BeforeCharge) {
		forget()
		return
	}
	var b [12]byte
	_, _ = rand.Read(b[:])
	c := Charge{ID: "ch_" + hex.EncodeToString(b[:]), Key: key, AmountCents: *req.AmountCents, CartID: req.CartID, At: time.Now()}
	body, _ := json.Marshal(map[string]any{"id": c.ID, "amount_cents": c.AmountCents, "cart_id": c.CartID})
	body = append(body, '\n')
	p.mu.Lock()
	p.charges = append(p.charges, c)
	if entry != nil {
		entry.done, entry.status, entry.answer = true, http.StatusCreated, body
	}
	delay := p.delay
	p.mu.Unlock()

	if !p.wait(r.Context(), AfterCharge) {
		return
	}
	if delay > 0 {
		t := time.NewTimer(delay)
		defer t.Stop()
		select {
		case <-t.C:
		case <-r.Context().Done():
			return
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	if _, err := w.Write(body); err == nil {
		if f, ok := w.(http.Flusher); ok {
			f.Flush()
		}
		p.mu.Lock()
		p.written[c.CartID]++
		p.mu.Unlock()
	}
}

// Answered returns how many charge answers (201) for cartID the provider has
// written to its clients, replays excluded.
func (p *Provider) Answered(cartID string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.written[cartID]
}

func answer(w http.ResponseWriter, status int, v any) {
	body, _ := json.Marshal(v)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(append(body, '\n'))
}
