package idem

import (
	"encoding/json"
	"net/http"
	"strconv"
)

// ProblemTypeBase prefixes every problem type URI idem sends; the fragment is the
// problem's code, documented in docs/errors.md under that anchor (the README
// keeps an anchor for every code too, for answers stored before that page existed).
const ProblemTypeBase = "https://github.com/idemkit/idem/blob/main/docs/errors.md#"

// Problem codes: the "code" member of every problem answer idem writes. They are
// API; docs/errors.md documents each.
const (
	CodeKeyMissing       = "idempotency_key_missing"
	CodeKeyInvalid       = "idempotency_key_invalid"
	CodeKeyInUse         = "idempotency_key_in_use"
	CodeKeyReused        = "idempotency_key_reused"
	CodeBodyTooLarge     = "idempotency_body_too_large"
	CodeBodyUnreadable   = "idempotency_body_unreadable"
	CodeStoreUnavailable = "idempotency_store_unavailable"
	CodeLeaseLost        = "idempotency_lease_lost"
	CodeCommitFailed     = "idempotency_commit_failed"
	CodeResponseTooLarge = "idempotency_response_too_large"
	CodeReplayFailed     = "idempotency_replay_failed"
	CodeTxAborted        = "idempotency_transaction_aborted"
	CodeTxConflict       = "idempotency_transaction_conflict"
	CodeOutcomeUnknown   = "idempotency_outcome_unknown"
)

// Problem is an RFC 9457 problem details object with idem's extension member
// "code".
type Problem struct {
	Type   string `json:"type"`
	Title  string `json:"title"`
	Status int    `json:"status"`
	Detail string `json:"detail,omitempty"`
	Code   string `json:"code"`
}

// problemTitles gives each code its fixed status and title.
var problemTitles = map[string]struct {
	status int
	title  string
}{
	CodeKeyMissing:       {http.StatusBadRequest, "Idempotency-Key header missing"},
	CodeKeyInvalid:       {http.StatusBadRequest, "Idempotency-Key header invalid"},
	CodeKeyInUse:         {http.StatusConflict, "A request with this idempotency key is in progress"},
	CodeKeyReused:        {http.StatusUnprocessableEntity, "Idempotency key reused with a different request"},
	CodeBodyTooLarge:     {http.StatusRequestEntityTooLarge, "Request body too large to fingerprint"},
	CodeBodyUnreadable:   {http.StatusBadRequest, "Request body could not be read"},
	CodeStoreUnavailable: {http.StatusServiceUnavailable, "Idempotency store unavailable"},
	CodeLeaseLost:        {http.StatusConflict, "Idempotency lease lost to another request"},
	CodeCommitFailed:     {http.StatusServiceUnavailable, "Transaction could not be committed"},
	CodeResponseTooLarge: {http.StatusInternalServerError, "Response too large to keep for replay"},
	CodeReplayFailed:     {http.StatusInternalServerError, "Stored outcome could not be replayed"},
	CodeTxAborted:        {http.StatusInternalServerError, "The database rolled back the handler's transaction"},
	CodeTxConflict:       {http.StatusServiceUnavailable, "The handler's transaction conflicted with a concurrent one"},
	CodeOutcomeUnknown:   {http.StatusServiceUnavailable, "The outcome of the request with this key is unknown"},
}

// NewProblem returns the problem for code, one of the Code constants, with the
// given detail. For a code of your own, fill in a Problem yourself.
func NewProblem(code, detail string) Problem {
	t := problemTitles[code]
	return Problem{Type: ProblemTypeBase + code, Title: t.title, Status: t.status, Detail: detail, Code: code}
}

// WriteProblem writes p as application/problem+json with p.Status. When
// retryAfter is positive it also sets Retry-After to that many seconds.
func WriteProblem(w http.ResponseWriter, p Problem, retryAfter int) {
	body, err := json.Marshal(p)
	if err != nil { // cannot happen for this struct
		body = []byte(`{"title":"internal error","status":500}`)
	}
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	h.Del("Content-Length")
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(retryAfter))
	}
	w.WriteHeader(p.Status)
	_, _ = w.Write(body)
}
