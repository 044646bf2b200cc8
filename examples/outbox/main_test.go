package main

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/examples/internal/exampletest"
	"github.com/idemkit/idem/internal/testenv"
)

// The outbox example against the real PostgreSQL and NATS: one order sent
// twice with one key is one order and one event on the stream, published by
// the relay with a Nats-Msg-Id; a bad request (400, no transaction commits
// an order) publishes nothing.
func TestOutboxExample(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := testenv.PostgresURL(t)
	nc, err := nats.Connect(testenv.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	sfx := exampletest.RandomHex(t)
	subject, stream := "example.outbox."+sfx, "EXAMPLE_OUTBOX_"+strings.ToUpper(sfx)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}}); err != nil {
		t.Fatal(err)
	}
	defer js.DeleteStream(context.Background(), stream)

	admin, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	schema := "example_outbox_" + sfx
	if _, err := admin.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	defer admin.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.RuntimeParams["search_path"] = schema
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()

	h, relay, err := newServer(ctx, pool, js, subject)
	if err != nil {
		t.Fatal(err)
	}
	rctx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { _ = relay.Run(rctx); close(done) }()
	defer func() { stop(); <-done }()
	srv := httptest.NewServer(h)
	defer srv.Close()
	first := ""
	for i := range 2 {
		status, replayed, body := exampletest.Post(t, srv.URL+"/orders", "outbox-key-1")
		if status != http.StatusCreated || (i == 1) != (replayed == "true") {
			t.Fatalf("request %d: %d %q (replayed %q)", i, status, body, replayed)
		}
		if i == 0 {
			first = body
		} else if body != first {
			t.Fatalf("the retry answered %q; want the stored %q", body, first)
		}
	}
	req, _ := http.NewRequest("POST", srv.URL+"/orders", strings.NewReader(`{}`))
	req.Header.Set("Idempotency-Key", "outbox-key-2")
	if resp, err := http.DefaultClient.Do(req); err != nil || resp.StatusCode != 400 {
		t.Fatalf("bad request: %v %v", resp, err)
	}
	s, _ := js.Stream(ctx, stream)
	var info *jetstream.StreamInfo
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if info, err = s.Info(ctx); err == nil && info.State.Msgs >= 1 {
			break
		}
	}
	time.Sleep(500 * time.Millisecond) // a second event, if any, would be there by now
	if info, err = s.Info(ctx); err != nil || info.State.Msgs != 1 {
		t.Fatalf("stream holds %v messages (%v); want the one order's one event", info.State.Msgs, err)
	}
	m, err := s.GetMsg(ctx, info.State.FirstSeq)
	if err != nil {
		t.Fatal(err)
	}
	if id := m.Header.Get(jetstream.MsgIDHeader); len(id) != 64 || !strings.Contains(string(m.Data), `"cart_id":"c_42"`) {
		t.Fatalf("event: Nats-Msg-Id %q, payload %s", id, m.Data)
	}
}
