package client

import (
	"context"
	"net/http"
	"strings"

	"github.com/google/uuid"
	"github.com/idemkit/idem"
)

// ReplayedHeader is the response header an idem server sets to "true" on an answer
// replayed from a stored outcome.
const ReplayedHeader = idem.ReplayedHeader

type keyCtx struct{}

type attemptCtx struct{}

// WithKey returns a copy of ctx that makes the Transport send key as the
// idempotency key of the request carrying ctx, instead of making a new one. Use it
// when the key must outlive one call to RoundTrip: a key derived from something
// the operation already has (a cart ID, a message ID — never a hash of the body,
// never anything personal), a key saved to retry an operation later, or a retrying
// client such as go-retryablehttp wrapped around the Transport, which calls
// RoundTrip once per attempt with the same context.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyCtx{}, key)
}

// KeyFrom returns the key stored in ctx by WithKey, and whether there was one.
func KeyFrom(ctx context.Context) (string, bool) {
	k, ok := ctx.Value(keyCtx{}).(string)
	return k, ok
}

// NewKey returns a new random key: a UUID version 4 in its 36-character text form.
// It is the default Transport.KeyFunc.
func NewKey() string { return uuid.NewString() }

// Attempts reports how many HTTP attempts the Transport made for the operation that
// produced resp: 1 when the first attempt was answered. It reads a value the
// Transport put in the context of resp.Request (the request of the last attempt),
// so it returns 0 for a response that did not come through a Transport, or for a
// request whose method the Transport does not key. Attempts made invisibly by the
// Base transport (net/http re-sends a request with an Idempotency-Key header on
// its own when a reused connection drops) are not counted.
func Attempts(resp *http.Response) int {
	if resp == nil || resp.Request == nil {
		return 0
	}
	n, _ := resp.Request.Context().Value(attemptCtx{}).(int)
	return n
}

// Replayed reports whether resp is a replay of a stored outcome (the server sent
// Idempotent-Replayed: true): the operation had already been carried out by an
// earlier attempt — or by an earlier operation that used the same key — and this
// answer repeats that outcome. The value is compared without regard to letter
// case or surrounding whitespace ("True" counts); the header is Stripe's
// convention, not an RFC 9651 structured field, so the sf-boolean "?1" does
// not. idem check judges replays with this same function.
func Replayed(resp *http.Response) bool {
	return resp != nil && strings.EqualFold(strings.TrimSpace(resp.Header.Get(ReplayedHeader)), "true")
}
