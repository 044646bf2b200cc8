package mysqloutbox_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/mysqlstore"
	"github.com/idemkit/idem/outbox"
)

func post(url, key string) (int, error) {
	req, _ := http.NewRequest("POST", url+"/orders", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", key)
	c := &http.Client{Timeout: 30 * time.Second}
	resp, err := c.Do(req)
	if err != nil {
		return 0, err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	return resp.StatusCode, nil
}

// TestEnqueueWithTheAnswer: through idem.New + mysqlstore over loopback HTTP
// on MariaDB, concurrent sends of each key: every committed order has its
// event (ID MessageID(scope, key, name)) once, replays enqueue nothing, and
// handlers that roll back leave none.
func TestEnqueueWithTheAnswer(t *testing.T) {
	ctx := context.Background()
	db := testDB(t)
	ob := newOutbox(t, db)
	table := "records_" + randHex(5)
	store, err := mysqlstore.New(db, &mysqlstore.Config{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	orders := "orders_" + randHex(5)
	if _, err := db.Exec("CREATE TABLE " + orders + " (k VARCHAR(255) PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = db.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_migrations, " + table + "_steps, " + orders)
	})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := mysqlstore.Tx(r.Context())
		_, key, _ := idem.KeyFrom(r.Context())
		if _, err := tx.ExecContext(r.Context(), "INSERT INTO "+orders+" (k) VALUES (?)", key); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if err := ob.Enqueue(r.Context(), nil, outbox.Message{Name: "order.created", Subject: "orders.created", Payload: []byte(key)}); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if strings.HasPrefix(key, "fail-") {
			_ = tx.Rollback()
			http.Error(w, "refused", http.StatusPaymentRequired)
			return
		}
		w.WriteHeader(http.StatusCreated)
	})
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mw(h)}
	go func() { _ = srv.Serve(ln) }()
	defer srv.Close()
	url := "http://" + ln.Addr().String()
	const keys, sends = 16, 3
	start := make(chan struct{})
	errs := make(chan error, keys*sends)
	for k := range keys {
		key := fmt.Sprint("order-", k)
		if k%4 == 0 {
			key = "fail-" + key
		}
		for range sends {
			go func() {
				<-start
				deadline := time.Now().Add(60 * time.Second)
				for {
					code, err := post(url, key)
					switch {
					case err != nil:
					case code == http.StatusCreated:
					case strings.HasPrefix(key, "fail-") && code != http.StatusConflict:
						// rolled back: whatever the answer, nothing committed
					case (code == http.StatusConflict || code == http.StatusServiceUnavailable) && time.Now().Before(deadline):
						time.Sleep(10 * time.Millisecond)
						continue
					default:
						err = fmt.Errorf("%s: %d", key, code)
					}
					errs <- err
					return
				}
			}()
		}
	}
	close(start)
	for range keys * sends {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	got := map[string]int{}
	rows, err := db.Query("SELECT id FROM " + ob.Table())
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		got[id]++
	}
	_ = rows.Close()
	for k := range keys {
		key := fmt.Sprint("order-", k)
		if k%4 == 0 {
			if got[outbox.MessageID("", "fail-"+key, "order.created")] != 0 {
				t.Fatalf("rolled-back fail-%s left an event", key)
			}
		} else if got[outbox.MessageID("", key, "order.created")] != 1 {
			t.Fatalf("%s: %d events, want 1", key, got[outbox.MessageID("", key, "order.created")])
		}
	}
	if len(got) != keys-keys/4 {
		t.Fatalf("%d events, want %d", len(got), keys-keys/4)
	}
}
