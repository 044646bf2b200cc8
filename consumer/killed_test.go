package consumer_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/pgstore"
)

// TestSessionKilledMidHandler: the PostgreSQL session of a handler's
// transaction is ended (pg_terminate_backend) while the handler runs. Its
// order is rolled back with it, so the delivery must not be acknowledged as
// executed; the redelivery runs the handler again and is acknowledged, a
// third is a duplicate, and one order is left in all. Likewise when the
// session is ended after the handler returned, before the commit.
func TestSessionKilledMidHandler(t *testing.T) {
	for _, when := range []string{"during", "after"} {
		t.Run(when, func(t *testing.T) {
			ctx := context.Background()
			pool, err := pgxpool.New(ctx, testenv.PostgresURL(t))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(pool.Close)
			sfx := fmt.Sprint(time.Now().UnixNano())
			s, err := pgstore.New(pool, &pgstore.Config{Table: "cons_kill_rec_" + sfx})
			if err == nil {
				err = s.Migrate(ctx)
			}
			orders := "cons_kill_" + sfx
			if err == nil {
				_, err = pool.Exec(ctx, "CREATE TABLE "+orders+" (id text)")
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				_, _ = pool.Exec(context.Background(), "DROP TABLE IF EXISTS "+orders+"; DROP TABLE IF EXISTS cons_kill_rec_"+sfx)
			})
			var runs atomic.Int64
			h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
				tx := pgstore.Tx(ctx)
				if _, err := tx.Exec(ctx, "INSERT INTO "+orders+" VALUES ($1)", m.ID); err != nil {
					return nil, err
				}
				if runs.Add(1) == 1 {
					var pid int32
					if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
						return nil, err
					}
					if _, err := pool.Exec(ctx, "SELECT pg_terminate_backend($1)", pid); err != nil {
						return nil, err
					}
					if when == "during" {
						var one int
						if err := tx.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
							return nil, err
						}
					}
				}
				return []byte("ok"), nil
			}
			p, err := consumer.New(s, consumer.Config{Name: "kill", MaxDeliveries: 5})
			if err != nil {
				t.Fatal(err)
			}
			first := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 1}, h)
			t.Logf("first: %+v", first)
			if first.Action == consumer.Ack {
				t.Errorf("first delivery acknowledged (%v, %v) although its transaction's session was ended", first.Reason, first.Err)
			}
			var second consumer.Outcome
			for d := 2; d < 6; d++ {
				second = p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: d}, h)
				t.Logf("delivery %d: %+v", d, second)
				if second.Action == consumer.Ack {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			if second.Action != consumer.Ack || second.Reason != consumer.Executed {
				t.Errorf("redelivery: %v %v %v, want Ack Executed", second.Action, second.Reason, second.Err)
			}
			third := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 9}, h)
			if third.Action != consumer.Ack || third.Reason != consumer.Duplicate {
				t.Errorf("third: %v %v %v, want Ack Duplicate", third.Action, third.Reason, third.Err)
			}
			var n int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+orders).Scan(&n); err != nil || n != 1 {
				t.Errorf("%d orders (%v), want 1", n, err)
			}
		})
	}
}
