package bench

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/sqlitestore"
)

// order is what the handler inserts and answers with.
type order struct {
	ID   int64  `json:"id"`
	Item string `json:"item"`
	Qty  int    `json:"qty"`
}

// backend is where the orders handler writes: one order row per executed request.
type backend interface {
	// insert writes one order, inside the request's idem transaction when ctx
	// carries one, and returns its ID.
	insert(ctx context.Context, item string, qty int) (int64, error)
	// count returns how many orders exist.
	count(ctx context.Context) (int64, error)
	// where says where the rows go, for the report.
	where() string
}

// ordersHandler decodes the order, inserts it through b and answers 201 with the
// order as JSON and its Location: the same work with and without idem.
func ordersHandler(b backend) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var in struct {
			Item string `json:"item"`
			Qty  int    `json:"qty"`
		}
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil || in.Item == "" || in.Qty < 1 {
			http.Error(w, "want {\"item\": \"…\", \"qty\": n}", http.StatusBadRequest)
			return
		}
		id, err := b.insert(r.Context(), in.Item, in.Qty)
		if err != nil {
			http.Error(w, "insert order: "+err.Error(), http.StatusInternalServerError)
			return
		}
		body, _ := json.Marshal(order{ID: id, Item: in.Item, Qty: in.Qty})
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/orders/"+strconv.FormatInt(id, 10))
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(body)
	})
}

// memBackend keeps orders in a map under a mutex.
type memBackend struct {
	mu     sync.Mutex
	orders map[int64]order
	next   int64
}

func newMemBackend() *memBackend { return &memBackend{orders: map[int64]order{}} }

func (m *memBackend) insert(_ context.Context, item string, qty int) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.next++
	m.orders[m.next] = order{ID: m.next, Item: item, Qty: qty}
	return m.next, nil
}

func (m *memBackend) count(context.Context) (int64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return int64(len(m.orders)), nil
}

func (m *memBackend) where() string { return "in-process map (mutex)" }

// sqliteBackend inserts into an orders table in the store's SQLite file.
type sqliteBackend struct {
	db    *sql.DB
	table string
}

func (s *sqliteBackend) insert(ctx context.Context, item string, qty int) (int64, error) {
	q := "INSERT INTO " + s.table + " (item, qty) VALUES (?, ?) RETURNING id"
	var id int64
	var err error
	if tx := sqlitestore.Tx(ctx); tx != nil {
		err = tx.QueryRowContext(ctx, q, item, qty).Scan(&id)
	} else {
		err = s.db.QueryRowContext(ctx, q, item, qty).Scan(&id)
	}
	return id, err
}

func (s *sqliteBackend) count(ctx context.Context) (int64, error) {
	var n int64
	err := s.db.QueryRowContext(ctx, "SELECT count(*) FROM "+s.table).Scan(&n)
	return n, err
}

func (s *sqliteBackend) where() string { return "SQLite table " + s.table + ", same file as the store" }

// pgBackend inserts into an orders table in the store's PostgreSQL database.
type pgBackend struct {
	pool  *pgxpool.Pool // the measured pool
	admin *pgxpool.Pool // bookkeeping, not counted
	table string
}

func (p *pgBackend) insert(ctx context.Context, item string, qty int) (int64, error) {
	q := "INSERT INTO " + p.table + " (item, qty) VALUES ($1, $2) RETURNING id"
	var id int64
	var err error
	if tx := pgstore.Tx(ctx); tx != nil {
		err = tx.QueryRow(ctx, q, item, qty).Scan(&id)
	} else {
		err = p.pool.QueryRow(ctx, q, item, qty).Scan(&id)
	}
	return id, err
}

func (p *pgBackend) count(ctx context.Context) (int64, error) {
	var n int64
	err := p.admin.QueryRow(ctx, "SELECT count(*) FROM "+p.table).Scan(&n)
	return n, err
}

func (p *pgBackend) where() string {
	return "PostgreSQL table " + p.table + ", same database as the store"
}

// mysqlBackend inserts into an orders table in the store's MySQL/MariaDB database.
type mysqlBackend struct {
	db    *sql.DB // the measured pool
	admin *sql.DB // bookkeeping, not counted
	table string
}

func (m *mysqlBackend) insert(ctx context.Context, item string, qty int) (int64, error) {
	q := "INSERT INTO " + m.table + " (item, qty) VALUES (?, ?)"
	var res sql.Result
	var err error
	if tx := mysqlstore.Conn(ctx); tx != nil {
		res, err = tx.ExecContext(ctx, q, item, qty)
	} else {
		res, err = m.db.ExecContext(ctx, q, item, qty)
	}
	if err != nil {
		return 0, err
	}
	return res.LastInsertId()
}

func (m *mysqlBackend) count(ctx context.Context) (int64, error) {
	var n int64
	err := m.admin.QueryRowContext(ctx, "SELECT count(*) FROM "+m.table).Scan(&n)
	return n, err
}

func (m *mysqlBackend) where() string {
	return "MariaDB/MySQL InnoDB table " + m.table + ", same database as the store"
}

// errUnavailable marks a store that could not be set up; the run goes on without it.
type errUnavailable struct{ err error }

func (e errUnavailable) Error() string { return e.err.Error() }

func unavailable(format string, args ...any) error {
	return errUnavailable{fmt.Errorf(format, args...)}
}

// pgBackendsCPU returns a function that sums the CPU time of the PostgreSQL
// backends serving connections named appName (the measured pool), read from
// /proc on this machine: it measures only when PostgreSQL runs here.
func pgBackendsCPU(admin *pgxpool.Pool, appName string) func(ctx context.Context) int64 {
	return func(ctx context.Context) int64 {
		rows, err := admin.Query(ctx, "SELECT pid FROM pg_stat_activity WHERE application_name = $1", appName)
		if err != nil {
			return -1
		}
		pids, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil || len(pids) == 0 {
			return -1
		}
		var sum int64
		for _, pid := range pids {
			ns := threadCPU(int(pid))
			if ns < 0 {
				return -1
			}
			sum += ns
		}
		return sum
	}
}
