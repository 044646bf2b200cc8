package client

import (
	"fmt"
	"strings"
	"time"
)

// RetryError is the error RoundTrip returns when an operation got no final answer:
// every attempt failed or was answered with a retryable status (409 in flight, 429,
// 502, 503, 504) and the attempts ran out, the request's context ended, or an
// attempt failed in a way that is not worth retrying. Answers that are final —
// 2xx, 400, 422, 500, any status not listed above — are returned as responses,
// never as a RetryError.
//
// The operation may or may not have been carried out. To learn its outcome, send
// it again later with the same key (WithKey(ctx, e.Key)) and the same body: an
// idem server replays what happened, or runs it if nothing did.
//
// http.Client wraps it in a *url.Error; errors.As finds it through that.
type RetryError struct {
	// Key is the idempotency key sent with every attempt.
	Key string
	// Attempts is how many attempts were made.
	Attempts int
	// Status is the status of the last answer, 0 when the last attempt got none.
	Status int
	// Code is the "code" member of the last answer's application/problem+json body
	// (for example "idempotency_key_in_use"), "" when there was none.
	Code string
	// Detail is the "detail" member of that problem body, "" when there was none.
	Detail string
	// RetryAfter is the wait the last answer asked for in its Retry-After header,
	// before capping; 0 when it sent none.
	RetryAfter time.Duration
	// Err is the error of the last attempt, nil when the last attempt was answered.
	Err error
	// Stop is why retrying stopped before MaxAttempts: the request context's error
	// (context.Canceled, or context.DeadlineExceeded also when the next attempt
	// could not have started before the deadline). Nil when the attempts ran out or
	// the last error was not retryable.
	Stop error
}

// Error describes the last outcome and what to do about it.
func (e *RetryError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "idem/client: no final answer after %d attempt", e.Attempts)
	if e.Attempts != 1 {
		b.WriteByte('s')
	}
	switch {
	case e.Stop != nil:
		fmt.Fprintf(&b, " (stopped: %v)", e.Stop)
	case e.Err != nil && !retryableErr(e.Err):
		b.WriteString(" (the last error is not one to retry)")
	}
	b.WriteString("; last ")
	if e.Err != nil {
		fmt.Fprintf(&b, "error: %v", e.Err)
	} else {
		fmt.Fprintf(&b, "answer: %d", e.Status)
		if e.Code != "" {
			fmt.Fprintf(&b, " %s", e.Code)
		}
		if e.Detail != "" {
			fmt.Fprintf(&b, " (%s)", e.Detail)
		}
	}
	fmt.Fprintf(&b, ". The operation may or may not have run: send it again later with the same body and key %q (client.WithKey) to get its outcome", e.Key)
	return b.String()
}

// Unwrap returns Err and Stop, those that are set, so that errors.Is finds both a
// transport error and context.DeadlineExceeded.
func (e *RetryError) Unwrap() []error {
	var errs []error
	if e.Err != nil {
		errs = append(errs, e.Err)
	}
	if e.Stop != nil {
		errs = append(errs, e.Stop)
	}
	return errs
}
