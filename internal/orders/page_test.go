package orders_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/orders"
)

// pageOf decodes a 200 GET /orders answer.
func pageOf(t *testing.T, a answer) orders.Page {
	t.Helper()
	var p orders.Page
	if a.status != 200 || json.Unmarshal(a.body, &p) != nil {
		t.Fatalf("GET /orders: %d %.300s", a.status, a.body)
	}
	return p
}

// walk follows "next" from first and returns every order listed, failing on a
// duplicate or a page larger than limit.
func walk(t *testing.T, s *served, auth, first string, limit int) (all []orders.Order, pages int) {
	t.Helper()
	seen := map[string]bool{}
	for path := first; path != ""; pages++ {
		if pages > 2000 {
			t.Fatal("more than 2000 pages: the cursor does not advance")
		}
		a := s.raw(t, "GET", path, auth, "", "")
		p := pageOf(t, a)
		if len(p.Orders) > limit {
			t.Fatalf("%s: %d orders on a page, limit %d", path, len(p.Orders), limit)
		}
		if p.Next != "" && a.header.Get("Link") != "<"+p.Next+`>; rel="next"` {
			t.Fatalf("%s: Link %q does not point at next %q", path, a.header.Get("Link"), p.Next)
		}
		for _, o := range p.Orders {
			if seen[o.ID] {
				t.Fatalf("%s: order %s listed twice", path, o.ID)
			}
			seen[o.ID] = true
			all = append(all, o)
		}
		path = p.Next
	}
	return all, pages
}

// TestPagination pages through more orders than a page holds, on every
// dialect, with every order created at the same instant (ties are broken by
// id), filtered by cart and not.
func TestPagination(t *testing.T) {
	t.Parallel()
	for _, dialect := range dialects {
		t.Run(dialect, func(t *testing.T) {
			t.Parallel()
			at := time.Date(2025, 1, 2, 3, 4, 5, 6000, time.UTC)
			s := serveDialect(t, dialect, orders.Config{NowFunc: func() time.Time { return at }})
			const auth = "Bearer t1"
			for i := range 23 {
				cart := []string{"c_a", "c_b"}[i%2]
				body := fmt.Sprintf(`{"cart_id":%q,"total_cents":%d}`, cart, i)
				if a := s.raw(t, "POST", "/orders", auth, fmt.Sprintf("p-%d", i), body); a.status != 201 {
					t.Fatalf("POST %d: %d %s", i, a.status, a.body)
				}
			}
			// Another tenant's orders never show up.
			if a := s.raw(t, "POST", "/orders", "Bearer t2", "p-other", `{"cart_id":"c_a","total_cents":1}`); a.status != 201 {
				t.Fatalf("POST t2: %d %s", a.status, a.body)
			}
			all, pages := walk(t, s, auth, "/orders?limit=5", 5)
			if len(all) != 23 || pages != 5 {
				t.Fatalf("walked %d orders in %d pages, want 23 in 5", len(all), pages)
			}
			for i := 1; i < len(all); i++ {
				if all[i-1].ID >= all[i].ID {
					t.Fatalf("orders with equal created_at are not in id order: %s then %s", all[i-1].ID, all[i].ID)
				}
			}
			carts, _ := walk(t, s, auth, "/orders?cart_id=c_b&limit=4", 4)
			if len(carts) != 11 {
				t.Fatalf("cart c_b: %d orders, want 11", len(carts))
			}
			for _, o := range carts {
				if o.CartID != "c_b" {
					t.Fatalf("cart filter lost on a later page: %+v", o)
				}
			}
			if def, _ := walk(t, s, auth, "/orders", orders.DefaultPageSize); len(def) != 23 {
				t.Fatalf("default page: %d orders, want 23", len(def))
			}
			last := pageOf(t, s.raw(t, "GET", "/orders?limit=23", auth, "", ""))
			if len(last.Orders) != 23 || last.Next != "" {
				t.Fatalf("a page that holds everything: %d orders, next %q; want 23 and no next", len(last.Orders), last.Next)
			}
			t2 := pageOf(t, s.raw(t, "GET", "/orders", "Bearer t2", "", ""))
			bad := []string{"limit=0", "limit=-1", "limit=1001", "limit=x", "after=nope", "after=%00", "after=" + t2.Orders[0].ID}
			for _, q := range bad {
				a := s.raw(t, "GET", "/orders?"+q, auth, "", "")
				if code, detail := problemCode(t, q, a, 400); code != "invalid_query" || !strings.Contains(detail, strings.SplitN(q, "=", 2)[0]) {
					t.Errorf("?%s: %q %q, want invalid_query naming the parameter", q, code, detail)
				}
			}
		})
	}
}

// TestListBeyondThousand: GET /orders used to stop at 1,000 orders without
// saying so. With 1,005 orders, the pages hold them all.
func TestListBeyondThousand(t *testing.T) {
	t.Parallel()
	s := serveDialect(t, "sqlite", orders.Config{})
	const n = 1005
	var vals []string
	var args []any
	base := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	for i := range n {
		vals = append(vals, "(?, 't1', 'c_many', 1, ?)")
		args = append(args, fmt.Sprintf("ord_%024x", i), base.Add(time.Duration(i)*time.Millisecond).Format("2006-01-02 15:04:05.000000"))
	}
	s.exec(t, "INSERT INTO "+s.table+" (id, tenant, cart_id, total_cents, created_at) VALUES "+strings.Join(vals, ","), args...)
	first := pageOf(t, s.raw(t, "GET", "/orders?cart_id=c_many&limit=1000", "Bearer t1", "", ""))
	if len(first.Orders) != 1000 || first.Next == "" {
		t.Fatalf("first page of 1,005: %d orders, next %q; want 1000 and a next link", len(first.Orders), first.Next)
	}
	all, pages := walk(t, s, "Bearer t1", "/orders?cart_id=c_many", orders.DefaultPageSize)
	if len(all) != n || pages != 11 {
		t.Fatalf("walked %d orders in %d pages, want %d in 11", len(all), pages, n)
	}
	for i, o := range all {
		if want := fmt.Sprintf("ord_%024x", i); o.ID != want {
			t.Fatalf("order %d is %s, want %s (oldest first)", i, o.ID, want)
		}
	}
}
