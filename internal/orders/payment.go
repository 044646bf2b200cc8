package orders

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"
)

// DefaultPaymentTimeout is how long one call to the payment provider may take
// unless Payments.Timeout says otherwise.
const DefaultPaymentTimeout = 10 * time.Second

// MaxChargeID is the longest charge id accepted from the provider, in bytes.
const MaxChargeID = 255

// Payments is the payment provider the service charges every new order at:
// POST URL/charges with {"amount_cents": total_cents, "cart_id": cart_id} and
// an Idempotency-Key; a 201 (or 200) {"id": "ch_…"} is the charge.
type Payments struct {
	// URL is the provider's base URL, for example https://pay.example.com/v1.
	URL string
	// Timeout bounds one call (connection, request and answer). Defaults to
	// DefaultPaymentTimeout.
	Timeout time.Duration
	// RefuseUnknown chooses what a retry does when an earlier attempt began
	// the charge and never recorded how it ended (the process died while the
	// provider was answering, or the call timed out): false (the default)
	// charges again with the same Idempotency-Key, which is safe at a provider
	// that honours the key; true refuses, making the order's outcome unknown
	// until an operator settles the charge with idem resolve — for a provider
	// that ignores keys, where charging again could charge twice.
	RefuseUnknown bool
	// Client makes the calls. Defaults to a client with Timeout.
	Client *http.Client
}

// DeclinedError is a charge the provider refused for good (a 4xx answer other
// than 408, 409, 425 and 429): the payment failed, and trying again with the
// same key would hear the same answer.
type DeclinedError struct {
	Status  int    // the provider's status
	Message string // the provider's message, bounded
}

func (e *DeclinedError) Error() string {
	return fmt.Sprintf("the payment provider declined the charge (%d): %s", e.Status, e.Message)
}

// ProviderError is a charge whose outcome the provider did not give: a 5xx, a
// transient 4xx (408, 409 key in use, 425, 429), no answer, a timeout, or an
// answer that is not a charge.
type ProviderError struct {
	Status int   // the provider's status; 0 when there was no answer
	Err    error // what went wrong
	// Sent reports whether the request may have reached the provider (so the
	// provider may have acted); false only when the connection could not be
	// made.
	Sent bool
}

func (e *ProviderError) Error() string {
	if e.Status != 0 {
		return fmt.Sprintf("the payment provider answered %d: %v", e.Status, e.Err)
	}
	return fmt.Sprintf("the payment provider did not answer: %v", e.Err)
}

func (e *ProviderError) Unwrap() error { return e.Err }

func (p *Payments) client() *http.Client {
	if p.Client != nil {
		return p.Client
	}
	t := p.Timeout
	if t <= 0 {
		t = DefaultPaymentTimeout
	}
	return &http.Client{Timeout: t}
}

// Charge asks the provider to charge totalCents for cartID with key as the
// Idempotency-Key and returns the charge's id. A final refusal is a
// *DeclinedError; anything else that went wrong a *ProviderError.
func (p *Payments) Charge(ctx context.Context, key, cartID string, totalCents int64) (string, error) {
	body, err := json.Marshal(struct {
		AmountCents int64  `json:"amount_cents"`
		CartID      string `json:"cart_id"`
	}{totalCents, cartID})
	if err != nil {
		return "", &ProviderError{Err: err}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, strings.TrimRight(p.URL, "/")+"/charges", bytes.NewReader(body))
	if err != nil {
		return "", &ProviderError{Err: err}
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := p.client().Do(req)
	if err != nil {
		return "", &ProviderError{Err: err, Sent: !isDialError(err)}
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	if err != nil {
		return "", &ProviderError{Status: resp.StatusCode, Err: fmt.Errorf("reading the answer: %w", err), Sent: true}
	}
	switch s := resp.StatusCode; {
	case s == http.StatusCreated || s == http.StatusOK:
		var c struct {
			ID string `json:"id"`
		}
		if err := json.Unmarshal(raw, &c); err != nil || c.ID == "" || len(c.ID) > MaxChargeID || checkText("the charge id", c.ID, MaxChargeID) != "" {
			return "", &ProviderError{Status: s, Err: fmt.Errorf("the answer %s is not a charge {\"id\": \"ch_…\"}", Quote(string(raw))), Sent: true}
		}
		return c.ID, nil
	case s == http.StatusRequestTimeout || s == http.StatusConflict || s == http.StatusTooEarly || s == http.StatusTooManyRequests:
		// Not a decline: the key is in use by a call still running, or the
		// provider asks to come back later.
		return "", &ProviderError{Status: s, Err: errors.New(providerMessage(raw)), Sent: true}
	case s >= 400 && s < 500:
		return "", &DeclinedError{Status: s, Message: providerMessage(raw)}
	default:
		return "", &ProviderError{Status: s, Err: errors.New(providerMessage(raw)), Sent: true}
	}
}

// providerMessage returns the message of a provider's error answer: Stripe's
// {"error": {"message": …}}, a top-level "message", or the text, bounded.
func providerMessage(raw []byte) string {
	var e struct {
		Error struct {
			Message string `json:"message"`
		} `json:"error"`
		Message string `json:"message"`
	}
	if json.Unmarshal(raw, &e) == nil {
		if e.Error.Message != "" {
			return Quote(e.Error.Message)
		}
		if e.Message != "" {
			return Quote(e.Message)
		}
	}
	if len(bytes.TrimSpace(raw)) == 0 {
		return "(no message)"
	}
	return Quote(string(bytes.TrimSpace(raw)))
}

// isDialError reports whether err happened before the request was sent.
func isDialError(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}
