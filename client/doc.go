// Package client is the client half of the idempotency contract: an
// http.RoundTripper that makes one key per operation, sends it with every retry of
// that operation, and retries only what is safe to retry.
//
//	c := client.New(nil) // or &http.Client{Transport: &client.Transport{…}}
//	resp, err := c.Post(url, "application/json", body)
//	// client.Attempts(resp), client.Replayed(resp); err may be a *client.RetryError
//
// # One key per operation
//
// A retry must carry the key of the operation it repeats, and a new operation a new
// key. The Transport treats each call to RoundTrip as one operation: it makes the
// key (a random UUID v4, Transport.KeyFunc) before the first attempt and sends the
// same key with every attempt. A key the caller brings wins: an Idempotency-Key
// header already on the request is sent as it is, and a key stored in the context
// with WithKey is used instead of a new one. Bring your own key when the operation
// outlives one call — an order you may resubmit after a crash, keyed by its cart ID
// — or when another retrying client calls RoundTrip once per attempt.
//
// Never make a key from the request body (two identical orders are two orders) and
// put nothing personal in it (keys end up in logs).
//
// # What is retried
//
// Only requests of the keyed methods (POST and PATCH unless Transport.Methods says
// otherwise) are keyed and retried; GET, PUT, DELETE and the rest go to the Base
// transport untouched, once.
//
//   - retried: connection errors and attempt timeouts, including a request that
//     was carried out but whose answer was lost; 409 in flight
//     (idempotency_key_in_use, idempotency_lease_lost, or any 409 with
//     Retry-After); 429; 502; 503; 504.
//   - returned as they are: every other answer — 2xx, 400, 422 and other 4xx, 500,
//     501. A 422 idempotency_key_reused means the key was used for a different
//     request: a bug in the caller, which a retry cannot fix.
//   - not retried either: a request body whose reader fails (ErrBodyUnreadable),
//     even when req.GetBody could make a new one. The request never reached the
//     server whole, so nothing ran, and the reader's error is the caller's to
//     see at once, not after MaxAttempts resends of the same broken source.
//
// A server that sends the headers of a retryable answer and then stalls its body
// does not hold the caller: that body (64 KiB of it at most) must arrive within
// AttemptTimeout, or MaxRetryBodyWait when there is none, or the attempt is
// abandoned, its connection closed, and retried.
//
// The wait before a retry is the answer's Retry-After (seconds or HTTP-date),
// capped at MaxRetryAfter, or else capped exponential backoff with full jitter: a
// random duration in [0, min(MaxBackoff, MinBackoff·2^n)] before retry n. Retries
// end after MaxAttempts, at once when the request context is cancelled, and
// without sleeping when the next attempt could not start before the context's
// deadline. The request body is resent from req.GetBody, or from a copy the
// Transport reads into memory first.
//
// # Outcomes
//
// A final answer is returned as the *http.Response of the last attempt. Attempts
// reports how many attempts it took and Replayed whether the server answered from
// a stored outcome (Idempotent-Replayed: true) — which is how a retry after a lost
// answer looks. When no attempt got a final answer RoundTrip returns a
// *RetryError with the key, the attempts, the last status and problem code, and
// the last transport error; the operation may or may not have run, and sending it
// again later with the same key (WithKey) and body tells which.
//
// # Under another retrying client
//
// A retrying client such as github.com/hashicorp/go-retryablehttp calls its
// transport once per attempt, so a Transport below it would see every attempt as
// a new operation. Make the key before that client's retry loop and hand it down
// in the context — the same context reaches every attempt:
//
//	ctx = client.WithKey(ctx, client.NewKey())
//	req, _ := retryablehttp.NewRequestWithContext(ctx, "POST", url, body)
//
// and set Transport.MaxAttempts to 1 so that retries are not multiplied. Setting
// the Idempotency-Key header on the request before the loop works as well.
//
// # Limits
//
//   - A request body without GetBody is read into memory before the first attempt,
//     whatever its size. Bodies from bytes.Reader, bytes.Buffer and strings.Reader
//     (http.NewRequest sets GetBody for them) are not copied. The copy ends with
//     the request context: a reader that stalls is closed then, and RoundTrip
//     returns the context's error without having sent anything.
//   - Attempts counts the Transport's attempts only: not the resends net/http makes
//     by itself on a dropped keep-alive connection, nor the attempts of a retrying
//     client wrapped around the Transport.
//   - http.Client follows a redirect with a new call to RoundTrip, which is a new
//     operation with a new key unless the key is in the header or the context.
//   - The whole operation, waits included, is bounded by MaxAttempts and the
//     request context only; http.Client.Timeout, when set, also covers it.
//
// # Testing
//
// Package clienttest provides a lossy TCP proxy that lets the server answer and
// then drops the answer, to prove end to end that retries through it create every
// order exactly once.
package client
