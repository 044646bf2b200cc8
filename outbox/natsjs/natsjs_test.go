package natsjs_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/natsjs"
	"github.com/idemkit/idem/pgstore"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// pgSchema returns a pool on a fresh schema, dropped when t ends.
func pgSchema(t *testing.T) (*pgxpool.Pool, string) {
	t.Helper()
	url := testenv.PostgresURL(t)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 8
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	schema := "idem_outbox_" + randHex(5)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	})
	return pool, schema
}

type broker struct {
	nc      *nats.Conn
	js      jetstream.JetStream
	stream  string
	subject string // the stream captures subject + ".>"
}

func newBroker(t *testing.T, sc jetstream.StreamConfig) *broker {
	t.Helper()
	url := testenv.NATSURL(t)
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatalf("connect to NATS at %s: %v", url, err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	s := randHex(5)
	b := &broker{nc: nc, js: js, stream: "IDEM_OUTBOX_" + s, subject: "idemoutbox" + s}
	sc.Name, sc.Subjects, sc.Storage = b.stream, []string{b.subject + ".>"}, jetstream.MemoryStorage
	if _, err := js.CreateStream(context.Background(), sc); err != nil {
		t.Fatalf("create stream (is JetStream enabled, nats-server -js?): %v", err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), b.stream) })
	return b
}

// messages returns the stream's messages by Nats-Msg-Id, with how often each
// is there.
func (b *broker) messages(t *testing.T) (map[string]*jetstream.RawStreamMsg, map[string]int) {
	t.Helper()
	ctx := context.Background()
	s, err := b.js.Stream(ctx, b.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got, count := map[string]*jetstream.RawStreamMsg{}, map[string]int{}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("get %d: %v", seq, err)
		}
		id := m.Header.Get(jetstream.MsgIDHeader)
		got[id] = m
		count[id]++
	}
	return got, count
}

// TestOrdersThroughOutbox: keyed requests through the real middleware on
// PostgreSQL over loopback HTTP enqueue one event each in the handler's
// transaction; rolled-back handlers and replayed retries enqueue nothing; the
// relay publishes every committed event once to JetStream with Nats-Msg-Id =
// MessageID(scope, key, name).
func TestOrdersThroughOutbox(t *testing.T) {
	pool, schema := pgSchema(t)
	ctx := context.Background()
	store, err := pgstore.New(pool, &pgstore.Config{Table: schema + ".idem_records"})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ob, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".idem_outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+schema+".orders (key text PRIMARY KEY)"); err != nil {
		t.Fatal(err)
	}
	b := newBroker(t, jetstream.StreamConfig{})
	subject := b.subject + ".orders.created"
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := pgstore.Tx(r.Context())
		_, key, _ := idem.KeyFrom(r.Context())
		if _, err := tx.Exec(r.Context(), "INSERT INTO "+schema+".orders (key) VALUES ($1)", key); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if err := ob.Enqueue(r.Context(), nil, outbox.Message{
			Name: "order.created", Subject: subject, Payload: []byte(`{"key":"` + key + `"}`),
			Headers: map[string]string{"Content-Type": "application/json"},
		}); err != nil {
			http.Error(w, err.Error(), 500)
			return
		}
		if strings.HasPrefix(key, "rollback-") {
			_ = tx.Rollback(r.Context())
			http.Error(w, "refused", http.StatusUnprocessableEntity)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, key)
	})
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: mw(handler)}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })

	var committed, rolledBack []string
	for i := range 30 {
		key := fmt.Sprintf("order-%d", i)
		if i%5 == 0 {
			key = "rollback-" + key
			rolledBack = append(rolledBack, key)
		} else {
			committed = append(committed, key)
		}
		for attempt := range 3 { // the first executes, the others replay
			req, _ := http.NewRequest("POST", "http://"+ln.Addr().String()+"/orders", strings.NewReader("{}"))
			req.Header.Set("Idempotency-Key", key)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			_ = resp.Body.Close()
			want := http.StatusCreated
			if strings.HasPrefix(key, "rollback-") {
				want = http.StatusUnprocessableEntity
			}
			if resp.StatusCode != want {
				t.Fatalf("%s attempt %d: %d, want %d", key, attempt, resp.StatusCode, want)
			}
		}
	}
	st, err := ob.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Pending != int64(len(committed)) {
		t.Fatalf("%d messages pending after %d committed orders (and %d rolled back, every key sent 3 times)", st.Pending, len(committed), len(rolledBack))
	}
	relay := &outbox.Relay{Source: ob, Publisher: natsjs.NewPublisher(b.js), PollInterval: 20 * time.Millisecond}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- relay.Run(rctx) }()
	deadline := time.Now().Add(20 * time.Second)
	for {
		st, err = ob.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("relay left %d messages unpublished", st.Pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	got, count := b.messages(t)
	if len(got) != len(committed) {
		t.Fatalf("stream holds %d distinct IDs, want %d", len(got), len(committed))
	}
	for _, key := range committed {
		id := outbox.MessageID("", key, "order.created")
		m := got[id]
		if m == nil {
			t.Fatalf("no event for committed order %s (ID %s)", key, id)
		}
		if count[id] != 1 || string(m.Data) != `{"key":"`+key+`"}` || m.Subject != subject || m.Header.Get("Content-Type") != "application/json" {
			t.Fatalf("event of %s: %d copies, %q on %s, headers %v", key, count[id], m.Data, m.Subject, m.Header)
		}
	}
	for _, key := range rolledBack {
		if got[outbox.MessageID("", key, "order.created")] != nil {
			t.Fatalf("an event was published for the rolled-back order %s", key)
		}
	}
}

// TestPermanentRefusals: a payload over the stream's max_msg_size and a
// subject no stream captures are Permanent; the relay dead-letters them with
// the reason and publishes the other partitions' messages.
func TestPermanentRefusals(t *testing.T) {
	pool, schema := pgSchema(t)
	ctx := context.Background()
	ob, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".idem_outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	b := newBroker(t, jetstream.StreamConfig{MaxMsgSize: 1000})
	enqueue := func(id, subject string, payload []byte) {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := ob.Enqueue(ctx, tx, outbox.Message{ID: id, Subject: subject, Payload: payload, PartitionKey: "p-" + id}); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	enqueue("big", b.subject+".x", make([]byte, 5000))
	enqueue("nostream", "nowhere"+randHex(4)+".x", []byte("x"))
	enqueue("ok", b.subject+".x", []byte("fine"))
	relay := &outbox.Relay{Source: ob, Publisher: natsjs.NewPublisher(b.js)}
	for range 3 {
		if _, err := relay.PublishBatch(ctx); err != nil {
			t.Fatal(err)
		}
	}
	dead, err := ob.DeadLetters(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	reasons := map[string]string{}
	for _, d := range dead {
		reasons[d.ID] = d.Reason
	}
	if len(dead) != 2 || !strings.Contains(reasons["big"], "maximum") || !strings.Contains(reasons["nostream"], "no stream captures") {
		t.Fatalf("dead letters: %v", reasons)
	}
	got, _ := b.messages(t)
	if len(got) != 1 || got["ok"] == nil {
		t.Fatalf("stream: %v", got)
	}
	st, err := ob.Stats(ctx)
	if err != nil || st.Pending != 0 || st.DeadLetters != 2 {
		t.Fatalf("stats %+v, %v", st, err)
	}
}
