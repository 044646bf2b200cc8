package main

import (
	"context"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/testenv"
)

// TestPublishTwiceOneOrder is the README's walkthrough: one order published
// twice under one ID (past JetStream's own duplicate window, which is set to
// its minimum here) makes one order.
func TestPublishTwiceOneOrder(t *testing.T) {
	nc, err := nats.Connect(testenv.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, err := Open(ctx, filepath.Join(t.TempDir(), "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	// A stream of this test's own, named as the example's would be.
	sfx := fmt.Sprint(time.Now().UnixNano())
	subj, stream := "orders.create."+sfx, "ORDERS_"+sfx
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subj}, Duplicates: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	defer js.DeleteStream(context.Background(), stream)
	for i := 0; i < 2; i++ {
		ack, err := js.Publish(ctx, subj, []byte(`{"cart_id":"c_1","total_cents":500}`), jetstream.WithMsgID("o-1"))
		if err != nil || ack.Duplicate {
			t.Fatalf("publish %d: %+v %v", i, ack, err)
		}
		time.Sleep(300 * time.Millisecond) // past the broker's window: both are stored
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: "w", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	run := func() {
		rctx, stop := context.WithCancel(ctx)
		defer stop()
		go func() {
			for {
				if info, err := cons.Info(ctx); err == nil && info.NumPending == 0 && info.NumAckPending == 0 {
					stop()
					return
				}
				time.Sleep(50 * time.Millisecond)
			}
		}()
		_ = w.consume(rctx, cons)
	}
	run()
	if n, err := w.Count(ctx); err != nil || n != 1 {
		t.Fatalf("%d orders (%v); want 1", n, err)
	}
}

// TestTenantsShareNoOrderIDs: two tenants' order "o-1" (published past
// JetStream's duplicate window) are two orders, each filed under its tenant;
// tenant t2 is not handed t1's order.
func TestTenantsShareNoOrderIDs(t *testing.T) {
	nc, err := nats.Connect(testenv.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, err := Open(ctx, filepath.Join(t.TempDir(), "orders.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	sfx := fmt.Sprint(time.Now().UnixNano())
	subj, stream := "orders.create."+sfx, "ORDERS_"+sfx
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subj}, Duplicates: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	defer js.DeleteStream(context.Background(), stream)
	for _, tenant := range []string{"t1", "t2", "t1"} {
		m := nats.NewMsg(subj)
		m.Header.Set(TenantHeader, tenant)
		m.Data = []byte(`{"cart_id":"c_1","total_cents":500}`)
		if _, err := js.PublishMsg(ctx, m, jetstream.WithMsgID("o-1")); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond) // past the broker's window: all are stored
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: "w", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	go func() {
		for {
			if info, err := cons.Info(ctx); err == nil && info.NumPending == 0 && info.NumAckPending == 0 {
				stop()
				return
			}
			time.Sleep(50 * time.Millisecond)
		}
	}()
	_ = w.consume(rctx, cons)
	rows, err := w.db.QueryContext(ctx, `SELECT tenant, count(*) FROM orders GROUP BY tenant ORDER BY tenant`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	got := ""
	for rows.Next() {
		var tenant string
		var n int
		if err := rows.Scan(&tenant, &n); err != nil {
			t.Fatal(err)
		}
		got += fmt.Sprintf("%s:%d ", tenant, n)
	}
	if got != "t1:1 t2:1 " {
		t.Fatalf("orders per tenant: %q; want one for t1 and one for t2", got)
	}
}
