package orders

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/idemkit/idem"
)

// DefaultTable is the name of the orders table unless Config.Table says otherwise.
const DefaultTable = "orders"

// MaxCartID is the longest cart_id accepted, in bytes.
const MaxCartID = 255

// MaxBody is the largest POST /orders body read, in bytes.
const MaxBody = 1 << 20

// MaxTenant is the longest tenant accepted, in bytes (the orders table keeps it
// in a VARCHAR(255) on MySQL).
const MaxTenant = 255

// DefaultPageSize is how many orders one GET /orders page holds unless ?limit=
// says otherwise; MaxPageSize is the largest ?limit= accepted.
const (
	DefaultPageSize = 100
	MaxPageSize     = 1000
)

// Order is one order as the API shows it.
type Order struct {
	ID         string    `json:"id"`
	CartID     string    `json:"cart_id"`
	TotalCents int64     `json:"total_cents"`
	CreatedAt  time.Time `json:"created_at"`
	// ChargeID is the payment provider's id of the order's charge; empty (and
	// left out of the JSON) when the service charges nothing (Config.Payments
	// nil).
	ChargeID string `json:"charge_id,omitempty"`
}

// Config configures a Service. A nil *Config means all defaults.
type Config struct {
	// Table is the orders table: a name, or schema.name on PostgreSQL and MySQL
	// (where a schema is a database). Defaults to "orders".
	Table string
	// HandlerDelay is how long POST /orders sleeps inside its transaction after the
	// insert, to widen race windows in demonstrations and tests. Defaults to 0.
	HandlerDelay time.Duration
	// TenantFunc returns the tenant a request belongs to. Defaults to the scope an
	// authentication middleware stored with idem.WithScope (see Authenticate).
	TenantFunc func(r *http.Request) string
	// NowFunc is the clock for created_at. Defaults to time.Now.
	NowFunc func() time.Time
	// Payments, when set, charges every new order's total before the order is
	// inserted (see Payments). Nil charges nothing.
	Payments *Payments
	// OnCreate, when set, is called inside the order's transaction right after
	// the insert (before HandlerDelay), with that transaction: what it writes
	// there (an outbox message) commits with the order, and its answer, or not
	// at all. An error rolls the order back (500 "order_not_saved").
	OnCreate func(ctx context.Context, tx Tx, tenant string, o Order) error
}

// Service is the reference checkout service: it creates and lists orders.
type Service struct {
	b      Backend
	cfg    Config
	bare   string // the table name without its schema
	insert string
	getOne string
	cols   string
}

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// New returns the service over b. It does not create the table: call Migrate.
func New(b Backend, cfg *Config) (*Service, error) {
	if b == nil {
		return nil, errors.New("orders: backend is nil; make one with orders.SQL or orders.Pgx")
	}
	s := &Service{b: b}
	if cfg != nil {
		s.cfg = *cfg
	}
	if s.cfg.Table == "" {
		s.cfg.Table = DefaultTable
	}
	parts := strings.Split(s.cfg.Table, ".")
	qualifiable := b.Dialect() == Postgres || b.Dialect() == MySQL
	if len(parts) > 2 || len(parts) == 2 && !qualifiable || !identRE.MatchString(parts[0]) || !identRE.MatchString(parts[len(parts)-1]) {
		return nil, fmt.Errorf("orders: table name %q is not a plain SQL identifier (or schema.table on PostgreSQL and MySQL); use letters, digits and underscores", s.cfg.Table)
	}
	s.bare = parts[len(parts)-1]
	if s.cfg.HandlerDelay < 0 {
		return nil, fmt.Errorf("orders: HandlerDelay is %v; use 0 or more", s.cfg.HandlerDelay)
	}
	if s.cfg.TenantFunc == nil {
		s.cfg.TenantFunc = func(r *http.Request) string { return idem.ScopeFrom(r.Context()) }
	}
	if s.cfg.NowFunc == nil {
		s.cfg.NowFunc = time.Now
	}
	t := s.cfg.Table
	if p := s.cfg.Payments; p != nil && p.URL == "" {
		return nil, errors.New("orders: Payments.URL is empty; give the payment provider's base URL, or leave Payments nil")
	}
	s.insert = "INSERT INTO " + t + " (id, tenant, cart_id, total_cents, created_at, charge_id) VALUES (?, ?, ?, ?, ?, ?)"
	s.cols = "SELECT id, cart_id, total_cents, created_at, COALESCE(charge_id, '') FROM " + t
	s.getOne = s.cols + " WHERE tenant = ? AND id = ?"
	return s, nil
}

// Table returns the name of the orders table.
func (s *Service) Table() string { return s.cfg.Table }

// Handler returns the service's routes:
//
//	POST /orders        create an order (wrapped in keyed)
//	GET  /orders/{id}   one order of the caller's tenant
//	GET  /orders        the caller's orders, filtered by ?cart_id=
//	GET  /healthz       200 when the database answers
//
// keyed wraps POST /orders, normally with the idem middleware; nil leaves it
// unwrapped. Routing happens before keyed, so an unknown path or method is never
// bound to a key.
func (s *Service) Handler(keyed func(http.Handler) http.Handler) http.Handler {
	var create http.Handler = http.HandlerFunc(s.create)
	if keyed != nil {
		create = keyed(create)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /orders", create)
	mux.HandleFunc("GET /orders/{id}", s.get)
	mux.HandleFunc("GET /orders", s.list)
	mux.HandleFunc("GET /healthz", s.Healthz)
	return mux
}

// Healthz answers 200 {"status":"ok"} when the database answers a ping, and 503
// otherwise.
func (s *Service) Healthz(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), 5*time.Second)
	defer cancel()
	if err := s.b.ping(ctx); err != nil {
		WriteProblem(w, http.StatusServiceUnavailable, "database_unavailable", "the business database does not answer: "+err.Error())
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"status": "ok"})
}

// createRequest is the body of POST /orders. Fields are raw so that the
// validation can say exactly what is wrong.
type createRequest struct {
	CartID     json.RawMessage `json:"cart_id"`
	TotalCents json.RawMessage `json:"total_cents"`
}

// tenant returns the request's tenant, or answers 401 and returns ok false
// when it cannot be stored (see checkText).
func (s *Service) tenant(w http.ResponseWriter, r *http.Request) (tenant string, ok bool) {
	tenant = s.cfg.TenantFunc(r)
	if msg := checkText("the tenant", tenant, MaxTenant); msg != "" {
		WriteProblem(w, http.StatusUnauthorized, "unauthorized", msg+"; in the demo the tenant is the bearer token")
		return "", false
	}
	return tenant, true
}

func (s *Service) create(w http.ResponseWriter, r *http.Request) {
	tenant, ok := s.tenant(w, r)
	if !ok {
		return
	}
	cartID, total, msg := parseCreate(r.Body)
	if msg != "" {
		WriteProblem(w, http.StatusBadRequest, "invalid_order", msg)
		return
	}
	o := Order{
		ID:         newID(),
		CartID:     cartID,
		TotalCents: total,
		CreatedAt:  s.cfg.NowFunc().UTC().Truncate(time.Microsecond),
	}
	ctx := r.Context()
	var charge any // NULL without payments
	if s.cfg.Payments != nil {
		// The charge comes first: the order is inserted only once it is paid.
		id, err := s.charge(ctx, o.CartID, o.TotalCents)
		if err != nil {
			s.writeChargeError(w, ctx, err)
			return
		}
		o.ChargeID, charge = id, id
	}
	err := s.b.inTx(ctx, func(q querier) error {
		if err := q.exec(ctx, s.insert, o.ID, tenant, o.CartID, o.TotalCents, s.timeArg(o.CreatedAt), charge); err != nil {
			return fmt.Errorf("insert order: %w", err)
		}
		if s.cfg.OnCreate != nil {
			if err := s.cfg.OnCreate(ctx, q.tx(), tenant, o); err != nil {
				return fmt.Errorf("after the insert: %w", err)
			}
		}
		if d := s.cfg.HandlerDelay; d > 0 {
			t := time.NewTimer(d)
			defer t.Stop()
			select {
			case <-t.C:
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		}
		return nil
	})
	if err != nil {
		if ctx.Err() != nil {
			WriteProblem(w, http.StatusServiceUnavailable, "request_cancelled", "the order was not created because the request was cancelled ("+context.Cause(ctx).Error()+"); retry with the same Idempotency-Key")
			return
		}
		WriteProblem(w, http.StatusInternalServerError, "order_not_saved", "the order could not be saved: "+err.Error())
		return
	}
	idem.SetRef(ctx, o.ID)
	w.Header().Set("Location", "/orders/"+o.ID)
	writeJSON(w, http.StatusCreated, o)
}

// parseCreate validates a POST /orders body. msg is empty when it is valid.
func parseCreate(body io.Reader) (cartID string, total int64, msg string) {
	const example = `; send {"cart_id": "c_42", "total_cents": 1900}`
	raw, err := io.ReadAll(io.LimitReader(body, MaxBody+1))
	if err != nil {
		return "", 0, "the request body could not be read: " + err.Error()
	}
	if len(raw) > MaxBody {
		return "", 0, fmt.Sprintf("the body is larger than %d bytes", MaxBody) + example
	}
	if !utf8.Valid(raw) {
		return "", 0, "the body is not valid UTF-8" + example
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	var req createRequest
	if err := dec.Decode(&req); err != nil {
		return "", 0, "the body is not a valid order (" + err.Error() + ")" + example
	}
	if dec.More() {
		return "", 0, "the body has data after the JSON object" + example
	}
	if len(req.CartID) == 0 || string(req.CartID) == "null" {
		return "", 0, "cart_id is missing" + example
	}
	if err := json.Unmarshal(req.CartID, &cartID); err != nil {
		return "", 0, "cart_id must be a string" + example
	}
	if msg := checkText("cart_id", cartID, MaxCartID); msg != "" {
		if cartID == "" {
			msg += example
		}
		return "", 0, msg
	}
	if len(req.TotalCents) == 0 || string(req.TotalCents) == "null" {
		return "", 0, "total_cents is missing" + example
	}
	total, err = strconv.ParseInt(string(req.TotalCents), 10, 64)
	if err != nil {
		return "", 0, "total_cents must be a whole number of cents, got " + Quote(string(req.TotalCents)) + example
	}
	if total < 0 {
		return "", 0, fmt.Sprintf("total_cents is %d; it cannot be negative", total)
	}
	return cartID, total, ""
}

func (s *Service) get(w http.ResponseWriter, r *http.Request) {
	tenant, ok := s.tenant(w, r)
	if !ok {
		return
	}
	id := r.PathValue("id")
	if !idRE.MatchString(id) {
		WriteProblem(w, http.StatusNotFound, "order_not_found", fmt.Sprintf("%s is not an order id; order ids are %s", Quote(id), idShape))
		return
	}
	list, err := s.query(r.Context(), s.getOne, tenant, id)
	if err != nil {
		WriteProblem(w, http.StatusInternalServerError, "database_error", "the order could not be read: "+err.Error())
		return
	}
	if len(list) == 0 {
		WriteProblem(w, http.StatusNotFound, "order_not_found", fmt.Sprintf("there is no order %s for this tenant", id))
		return
	}
	writeJSON(w, http.StatusOK, list[0])
}

// Page is one page of GET /orders.
type Page struct {
	// Orders are the orders of the page, oldest first.
	Orders []Order `json:"orders"`
	// Next is the URL path and query of the next page; empty on the last page.
	Next string `json:"next,omitempty"`
}

// PageQuery selects a page of a tenant's orders.
type PageQuery struct {
	// CartID keeps only the orders of this cart when not empty.
	CartID string
	// After is the id of the last order of the previous page; empty for the
	// first page.
	After string
	// Limit is the most orders the page holds; 0 means DefaultPageSize.
	Limit int
}

// errBadQuery marks a PageQuery that names an order the tenant does not have.
var errBadQuery = errors.New("orders: bad query")

func (s *Service) list(w http.ResponseWriter, r *http.Request) {
	tenant, ok := s.tenant(w, r)
	if !ok {
		return
	}
	q := r.URL.Query()
	var pq PageQuery
	if q.Has("cart_id") {
		pq.CartID = q.Get("cart_id")
		if msg := checkText("cart_id", pq.CartID, MaxCartID); msg != "" {
			WriteProblem(w, http.StatusBadRequest, "invalid_query", msg)
			return
		}
	}
	if q.Has("after") {
		pq.After = q.Get("after")
		if !idRE.MatchString(pq.After) {
			WriteProblem(w, http.StatusBadRequest, "invalid_query", fmt.Sprintf("after=%s is not an order id; pass the id of the last order of the previous page (%s), or follow \"next\"", Quote(pq.After), idShape))
			return
		}
	}
	if q.Has("limit") {
		n, err := strconv.Atoi(q.Get("limit"))
		if err != nil || n < 1 || n > MaxPageSize {
			WriteProblem(w, http.StatusBadRequest, "invalid_query", fmt.Sprintf("limit=%s is not a whole number from 1 to %d", Quote(q.Get("limit")), MaxPageSize))
			return
		}
		pq.Limit = n
	}
	page, err := s.Page(r.Context(), tenant, pq)
	if errors.Is(err, errBadQuery) {
		WriteProblem(w, http.StatusBadRequest, "invalid_query", fmt.Sprintf("after=%s names no order of this tenant; pass the id of the last order of the previous page, or follow \"next\"", pq.After))
		return
	}
	if err != nil {
		WriteProblem(w, http.StatusInternalServerError, "database_error", "the orders could not be read: "+err.Error())
		return
	}
	if page.Next != "" {
		page.Next = r.URL.Path + "?" + page.Next
		w.Header().Set("Link", "<"+page.Next+`>; rel="next"`)
	}
	writeJSON(w, http.StatusOK, page)
}

// Page returns one page of tenant's orders, oldest first (ties broken by id).
// Page.Next is the query string of the next page ("after=…&limit=…", with
// cart_id when filtered), empty on the last page. A PageQuery.After that names
// no order of the tenant is an error.
func (s *Service) Page(ctx context.Context, tenant string, pq PageQuery) (Page, error) {
	limit := pq.Limit
	if limit <= 0 {
		limit = DefaultPageSize
	}
	limit = min(limit, MaxPageSize)
	where := " WHERE tenant = ?"
	args := []any{tenant}
	if pq.CartID != "" {
		where += " AND cart_id = ?"
		args = append(args, pq.CartID)
	}
	if pq.After != "" {
		prev, err := s.query(ctx, s.getOne, tenant, pq.After)
		if err != nil {
			return Page{}, err
		}
		if len(prev) == 0 {
			return Page{}, fmt.Errorf("%w: after=%s names no order of the tenant", errBadQuery, pq.After)
		}
		at := s.timeArg(prev[0].CreatedAt)
		where += " AND (created_at > ? OR (created_at = ? AND id > ?))"
		args = append(args, at, at, pq.After)
	}
	list, err := s.query(ctx, s.cols+where+" ORDER BY created_at, id LIMIT "+strconv.Itoa(limit+1), args...)
	if err != nil {
		return Page{}, err
	}
	p := Page{Orders: list}
	if p.Orders == nil {
		p.Orders = []Order{}
	}
	if len(list) > limit {
		p.Orders = list[:limit]
		next := url.Values{"after": {list[limit-1].ID}, "limit": {strconv.Itoa(limit)}}
		if pq.CartID != "" {
			next.Set("cart_id", pq.CartID)
		}
		p.Next = next.Encode()
	}
	return p, nil
}

// Orders returns the first page (at most DefaultPageSize) of tenant's orders for
// cartID, oldest first.
func (s *Service) Orders(ctx context.Context, tenant, cartID string) ([]Order, error) {
	p, err := s.Page(ctx, tenant, PageQuery{CartID: cartID})
	return p.Orders, err
}

func (s *Service) query(ctx context.Context, q string, args ...any) ([]Order, error) {
	var out []Order
	err := s.b.db().query(ctx, q, args, func(scan func(...any) error) error {
		var o Order
		var created any
		if err := scan(&o.ID, &o.CartID, &o.TotalCents, &created, &o.ChargeID); err != nil {
			return err
		}
		t, err := parseTime(created)
		if err != nil {
			return fmt.Errorf("order %s: %w", o.ID, err)
		}
		o.CreatedAt = t
		out = append(out, o)
		return nil
	})
	return out, err
}

// sqliteTime is how created_at is kept in SQLite: UTC, fixed width, so that text
// order is time order.
const sqliteTime = "2006-01-02 15:04:05.000000"

func (s *Service) timeArg(t time.Time) any {
	if s.b.Dialect() == SQLite {
		return t.Format(sqliteTime)
	}
	return t
}

func parseTime(v any) (time.Time, error) {
	switch v := v.(type) {
	case time.Time:
		return v.UTC(), nil
	case string:
		return parseTimeText(v)
	case []byte:
		return parseTimeText(string(v))
	}
	return time.Time{}, fmt.Errorf("created_at has unexpected type %T", v)
}

func parseTimeText(s string) (time.Time, error) {
	for _, layout := range []string{sqliteTime, time.RFC3339Nano, "2006-01-02 15:04:05.999999999-07:00", "2006-01-02T15:04:05Z"} {
		if t, err := time.Parse(layout, s); err == nil {
			return t.UTC(), nil
		}
	}
	return time.Time{}, fmt.Errorf("created_at %q is not a time", s)
}

func newID() string {
	var b [12]byte
	_, _ = rand.Read(b[:])
	return "ord_" + hex.EncodeToString(b[:])
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		WriteProblem(w, http.StatusInternalServerError, "internal_error", err.Error())
		return
	}
	body = append(body, '\n')
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// WriteProblem writes an RFC 9457 problem with the service's own code (for
// example "invalid_order"). Its type URI is idem.ProblemTypeBase + code.
func WriteProblem(w http.ResponseWriter, status int, code, detail string) {
	title := http.StatusText(status)
	if title == "" {
		title = "Error"
	}
	idem.WriteProblem(w, idem.Problem{
		Type:   idem.ProblemTypeBase + code,
		Title:  title,
		Status: status,
		Detail: detail,
		Code:   code,
	}, 0)
}

// Authenticate is the demo's authentication: the tenant is the bearer token of
// the Authorization header, stored with idem.WithScope. A request without one,
// or with two header lines, is answered 401 before it reaches anything behind,
// so it is never bound to an idempotency key. Real services verify the token;
// this one trusts it.
func Authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n := len(r.Header.Values("Authorization")); n > 1 {
			// Authorization is a singleton field (RFC 9110 §11.6.2): taking one
			// of two would let whoever added the other choose the tenant.
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem demo", error="invalid_request"`)
			WriteProblem(w, http.StatusUnauthorized, "unauthorized", fmt.Sprintf("%d Authorization header lines were sent; send exactly one, \"Authorization: Bearer <tenant>\"", n))
			return
		}
		auth := r.Header.Get("Authorization")
		scheme, token, ok := strings.Cut(auth, " ")
		token = strings.TrimSpace(token)
		if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem demo"`)
			WriteProblem(w, http.StatusUnauthorized, "unauthorized", `send "Authorization: Bearer <tenant>"; in the demo the token is the tenant name, for example "Authorization: Bearer t1"`)
			return
		}
		if len(token) > MaxTenant || !b64token(token) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem demo", error="invalid_token"`)
			WriteProblem(w, http.StatusUnauthorized, "unauthorized", fmt.Sprintf("the bearer token (%d bytes) is not 1 to %d characters of letters, digits and -._~+/ (then = padding); in the demo the token is the tenant name, for example \"Authorization: Bearer t1\"", len(token), MaxTenant))
			return
		}
		next.ServeHTTP(w, r.WithContext(idem.WithScope(r.Context(), token)))
	})
}
