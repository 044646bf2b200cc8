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
	"regexp"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
)

// DefaultTable is the name of the orders table unless Config.Table says otherwise.
const DefaultTable = "orders"

// MaxCartID is the longest cart_id accepted, in bytes.
const MaxCartID = 255

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
}

// Config configures a Service. A nil *Config means all defaults.
type Config struct {
	// Table is the orders table. Defaults to "orders".
	Table string
	// HandlerDelay is how long POST /orders sleeps inside its transaction after the
	// insert, to widen race windows in demonstrations and tests. Defaults to 0.
	HandlerDelay time.Duration
	// TenantFunc returns the tenant a request belongs to. Defaults to the scope an
	// authentication middleware stored with idem.WithScope (see Authenticate).
	TenantFunc func(r *http.Request) string
	// NowFunc is the clock for created_at. Defaults to time.Now.
	NowFunc func() time.Time
}

// Service is the reference checkout service: it creates and lists orders.
type Service struct {
	b      Backend
	cfg    Config
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
	if !identRE.MatchString(s.cfg.Table) {
		return nil, fmt.Errorf("orders: table name %q is not a plain SQL identifier; use letters, digits and underscores", s.cfg.Table)
	}
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
	s.insert = "INSERT INTO " + t + " (id, tenant, cart_id, total_cents, created_at) VALUES (?, ?, ?, ?, ?)"
	s.cols = "SELECT id, cart_id, total_cents, created_at FROM " + t
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

func (s *Service) create(w http.ResponseWriter, r *http.Request) {
	tenant := s.cfg.TenantFunc(r)
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
	err := s.b.inTx(ctx, func(q querier) error {
		if err := q.exec(ctx, s.insert, o.ID, tenant, o.CartID, o.TotalCents, s.timeArg(o.CreatedAt)); err != nil {
			return fmt.Errorf("insert order: %w", err)
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
	raw, err := io.ReadAll(io.LimitReader(body, 1<<20))
	if err != nil {
		return "", 0, "the request body could not be read: " + err.Error()
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
	if cartID == "" {
		return "", 0, "cart_id is empty" + example
	}
	if len(cartID) > MaxCartID {
		return "", 0, fmt.Sprintf("cart_id is %d bytes long; the most is %d", len(cartID), MaxCartID)
	}
	if len(req.TotalCents) == 0 || string(req.TotalCents) == "null" {
		return "", 0, "total_cents is missing" + example
	}
	total, err = strconv.ParseInt(string(req.TotalCents), 10, 64)
	if err != nil {
		return "", 0, "total_cents must be a whole number of cents, got " + string(req.TotalCents) + example
	}
	if total < 0 {
		return "", 0, fmt.Sprintf("total_cents is %d; it cannot be negative", total)
	}
	return cartID, total, ""
}

func (s *Service) get(w http.ResponseWriter, r *http.Request) {
	tenant := s.cfg.TenantFunc(r)
	id := r.PathValue("id")
	list, err := s.query(r.Context(), s.getOne, tenant, id)
	if err != nil {
		WriteProblem(w, http.StatusInternalServerError, "database_error", "the order could not be read: "+err.Error())
		return
	}
	if len(list) == 0 {
		WriteProblem(w, http.StatusNotFound, "order_not_found", fmt.Sprintf("there is no order %q for this tenant", id))
		return
	}
	writeJSON(w, http.StatusOK, list[0])
}

func (s *Service) list(w http.ResponseWriter, r *http.Request) {
	tenant := s.cfg.TenantFunc(r)
	var (
		list []Order
		err  error
	)
	if q := r.URL.Query(); q.Has("cart_id") {
		list, err = s.query(r.Context(), s.byCart, tenant, q.Get("cart_id"))
	} else {
		list, err = s.query(r.Context(), s.all, tenant)
	}
	if err != nil {
		WriteProblem(w, http.StatusInternalServerError, "database_error", "the orders could not be read: "+err.Error())
		return
	}
	if list == nil {
		list = []Order{}
	}
	writeJSON(w, http.StatusOK, map[string][]Order{"orders": list})
}

// Orders returns the orders of tenant for cartID, oldest first (at most ListLimit).
func (s *Service) Orders(ctx context.Context, tenant, cartID string) ([]Order, error) {
	return s.query(ctx, s.byCart, tenant, cartID)
}

func (s *Service) query(ctx context.Context, q string, args ...any) ([]Order, error) {
	var out []Order
	err := s.b.db().query(ctx, q, args, func(scan func(...any) error) error {
		var o Order
		var created any
		if err := scan(&o.ID, &o.CartID, &o.TotalCents, &created); err != nil {
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
// the Authorization header, stored with idem.WithScope. A request without one is
// answered 401 before it reaches anything behind, so it is never bound to an
// idempotency key. Real services verify the token; this one trusts it.
func Authenticate(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		auth := r.Header.Get("Authorization")
		scheme, token, ok := strings.Cut(auth, " ")
		token = strings.TrimSpace(token)
		if !ok || !strings.EqualFold(scheme, "Bearer") || token == "" {
			w.Header().Set("WWW-Authenticate", `Bearer realm="idem demo"`)
			WriteProblem(w, http.StatusUnauthorized, "unauthorized", `send "Authorization: Bearer <tenant>"; in the demo the token is the tenant name, for example "Authorization: Bearer t1"`)
			return
		}
		next.ServeHTTP(w, r.WithContext(idem.WithScope(r.Context(), token)))
	})
}
