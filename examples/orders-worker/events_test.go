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

// TestEventsAppliedOnce: the demo's event for one order, published three
// times under one message ID (past JetStream's duplicate window, as a relay
// that crashed before marking it published would), and a second order's
// event once, are fulfilled once each: one row per order in the fulfilments
// table. Built with -tags idem_broken_worker (no dedupe) it fails with 3 rows.
func TestEventsAppliedOnce(t *testing.T) {
	nc, err := nats.Connect(testenv.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	w, err := Open(ctx, filepath.Join(t.TempDir(), "fulfilments.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	sfx := fmt.Sprint(time.Now().UnixNano())
	subj, stream := "orders.created."+sfx, "ORDER_EVENTS_"+sfx
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subj}, Duplicates: 100 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	defer js.DeleteStream(context.Background(), stream)
	if got, err := EnsureEventsStream(ctx, js, subj); err != nil || got != stream {
		t.Fatalf("EnsureEventsStream found %q (%v); want the existing %s", got, err, stream)
	}
	pub := func(id, order string) {
		m := nats.NewMsg(subj)
		m.Header.Set(TenantHeader, "t1")
		m.Data = fmt.Appendf(nil, `{"order_id":%q,"cart_id":"c_1","tenant":"t1","total_cents":500,"created_at":"2026-12-01T00:00:00Z"}`, order)
		if _, err := js.PublishMsg(ctx, m, jetstream.WithMsgID(id)); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond) // past the broker's window: every copy is stored
	}
	pub("ev-1", "ord_1")
	pub("ev-1", "ord_1")
	pub("ev-2", "ord_2")
	pub("ev-1", "ord_1")
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
	_ = w.consumeEvents(rctx, cons)
	applied, err := w.Applied(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(applied) != 2 || applied["ord_1"] != 1 || applied["ord_2"] != 1 {
		t.Fatalf("fulfilments per order: %v; want ord_1:1 ord_2:1", applied)
	}
}
