package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/pgstore/pgoutbox"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// TestDemoEvents: on SQLite, PostgreSQL and MariaDB, idem demo --events
// creates a stream for its subject, and publishes one event per order: its
// payload names the order as GET /orders shows it (order_id, cart_id,
// tenant), its Nats-Msg-Id is the same for the order's retries (which
// enqueue nothing), and a bad request (400, nothing committed) publishes
// nothing. The demo then stops cleanly with its relay.
func TestDemoEvents(t *testing.T) {
	natsURL := testenv.NATSURL(t)
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close) // the subtests run after this function returns
	js, _ := jetstream.New(nc)
	dbs := map[string]func(t *testing.T) string{
		"sqlite":   func(t *testing.T) string { return "sqlite:" + filepath.Join(t.TempDir(), "demo.db") },
		"postgres": newPostgresDatabase,
		"mariadb":  func(t *testing.T) string { u, _ := newMySQLDatabase(t); return u },
	}
	for name, mk := range dbs {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			db := mk(t)
			subject := "demo." + cliRandHex(4) + ".created"
			stream := eventsStreamName(subject)
			t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
			metrics := closedPort(t)
			d := startDemo(t, t.TempDir(), nil, "--metrics-addr", metrics, "--db", db, "--events", natsURL, "--events-subject", subject)
			if !strings.Contains(d.output(), "events: every order's event is written to idem_outbox") {
				t.Errorf("the banner does not say where the events go:\n%s", d.output())
			}
			var want []orderJSON
			for i := range 3 {
				key := fmt.Sprintf("ev-%d-%s", i, cliRandHex(4))
				body := fmt.Sprintf(`{"cart_id":"c_ev%d","total_cents":%d}`, i, 100*i)
				a := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body)
				if a.Status != 201 {
					t.Fatalf("POST: %d %s", a.Status, a.Body)
				}
				o := a.order(t)
				if r := sendHTTP(t, "POST", d.URL+"/orders", "t1", key, body); !r.replayed() || r.order(t).ID != o.ID {
					t.Fatalf("retry: %d %s, want the replay", r.Status, r.Body)
				}
				want = append(want, listOrders(t, d.URL, "t1", fmt.Sprintf("c_ev%d", i))...)
			}
			if a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "ev-bad-"+cliRandHex(4), `{"cart_id":""}`); a.Status != 400 {
				t.Fatalf("bad order: %d %s", a.Status, a.Body)
			}
			var info *jetstream.StreamInfo
			ctx := context.Background()
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
				s, err := js.Stream(ctx, stream)
				if err == nil {
					if info, err = s.Info(ctx); err == nil && info.State.Msgs >= 3 {
						break
					}
				}
				if time.Now().After(deadline) {
					t.Fatalf("the stream %s does not hold the 3 events after 20 s (%v, %+v); output:\n%s", stream, err, info, d.output())
				}
			}
			time.Sleep(500 * time.Millisecond) // a fourth one would be there by now
			// The relay's metrics are on the demo's /metrics.
			resp, err := http.Get("http://" + metrics + "/metrics")
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if !strings.Contains(string(body), "idem_outbox_published_total 3") {
				t.Errorf("/metrics does not count the 3 publications:\n%s", body)
			}
			if code := d.stop(t); code != 0 {
				t.Errorf("the demo exited %d; output:\n%s", code, d.output())
			}
			events := readStream(t, js, stream)
			if len(events) != 3 || len(want) != 3 {
				t.Fatalf("%d events for %d orders: %+v", len(events), len(want), events)
			}
			// Each order's event, in any order: the orders are of different
			// keys (partitions), which the relay may publish at once.
			byID := map[string]orderJSON{}
			for _, o := range want {
				byID[o.ID] = o
			}
			ids := map[string]bool{}
			for i, e := range events {
				o, found := byID[e.OrderID]
				delete(byID, e.OrderID)
				if !found || e.OrderID != o.ID || e.CartID != o.CartID || e.Tenant != "t1" || e.header != "t1" || e.TotalCents != o.TotalCents {
					t.Errorf("event %d: %+v; want order %+v of tenant t1", i, e, o)
				}
				if len(e.msgID) != 64 || ids[e.msgID] {
					t.Errorf("event %d: Nats-Msg-Id %q (seen before: %v)", i, e.msgID, ids[e.msgID])
				}
				ids[e.msgID] = true
			}
			if strings.Contains(d.output(), "level=ERROR") {
				t.Errorf("the demo logged an error:\n%s", d.output())
			}
		})
	}
}

// TestRelayDeadLetters: `idem relay` dead-letters a message no stream
// captures (with the reason), publishes the others, exits when the outbox
// is empty with --exit-when-empty, and --dead-letters and --stats show it.
func TestRelayDeadLetters(t *testing.T) {
	natsURL := testenv.NATSURL(t)
	db := newPostgresDatabase(t)
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	subject := "relay." + cliRandHex(4) + ".created"
	stream := testStream(t, js, subject)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ob, err := pgoutbox.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for _, m := range []outbox.Message{
			{ID: "m-1", Subject: subject, Payload: []byte(`{"n":1}`)},
			{ID: "m-lost", Subject: "nostream." + cliRandHex(4), Payload: []byte(`{"n":2}`)},
			{ID: "m-3", Subject: subject, Payload: []byte(`{"n":3}`)},
		} {
			if err := ob.Enqueue(ctx, tx, m); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--nats", natsURL, "--exit-when-empty", "--poll", "50ms")
	if code != 0 || !strings.Contains(out, "the outbox is empty; stopped") || !strings.Contains(errOut, "dead-lettered") {
		t.Fatalf("idem relay --exit-when-empty: exit %d\n%s\n%s", code, out, errOut)
	}
	msgs, ids := streamMsgIDs(t, js, stream)
	if msgs != 2 || ids["m-1"] != 1 || ids["m-3"] != 1 {
		t.Errorf("the stream holds %d messages %v; want m-1 and m-3", msgs, ids)
	}
	code, out, _ = runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--dead-letters")
	if code != 0 || !strings.Contains(out, "id m-lost") || !strings.Contains(out, "no stream captures subject") {
		t.Errorf("idem relay --dead-letters: exit %d\n%s", code, out)
	}
	code, out, _ = runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--dead-letters", "--json")
	var dl deadLetter
	if code != 0 || json.Unmarshal([]byte(out), &dl) != nil || dl.ID != "m-lost" || dl.Payload != `{"n":2}` {
		t.Errorf("idem relay --dead-letters --json: exit %d %q", code, out)
	}
	code, out, _ = runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--stats")
	if code != 0 || !strings.Contains(out, "0 pending") || !strings.Contains(out, "1 dead-lettered") {
		t.Errorf("idem relay --stats: exit %d %q", code, out)
	}
	// Repaired (a stream for its subject), the dead letter is redriven and
	// published under its own ID.
	lost := testStream(t, js, dl.Subject)
	if code, out, errOut := runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--redrive", "999999"); code != 1 || !strings.Contains(errOut, "named no dead letter") {
		t.Errorf("idem relay --redrive of an unknown seq: exit %d %q %q", code, out, errOut)
	}
	if code, out, errOut := runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--redrive", "all"); code != 0 || !strings.Contains(out, "redrove 1 dead letters") {
		t.Fatalf("idem relay --redrive all: exit %d %q %q", code, out, errOut)
	}
	if code, out, errOut := runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--nats", natsURL, "--exit-when-empty", "--poll", "50ms"); code != 0 {
		t.Fatalf("idem relay after the redrive: exit %d\n%s\n%s", code, out, errOut)
	}
	if msgs, ids := streamMsgIDs(t, js, lost); msgs != 1 || ids["m-lost"] != 1 {
		t.Errorf("after the redrive the stream of its subject holds %d messages %v; want m-lost", msgs, ids)
	}
	code, out, _ = runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--stats")
	if code != 0 || !strings.Contains(out, "0 pending") || !strings.Contains(out, "0 dead-lettered") {
		t.Errorf("idem relay --stats after the redrive: exit %d %q", code, out)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"relay", "--db", db}, "name the broker"},
		{[]string{"relay", "--nats", natsURL}, "--db is required"},
		{[]string{"relay", "--db", db, "--nats", "http://x"}, "is not a NATS URL"},
		{[]string{"relay", "--db", db, "--nats", natsURL, "--amqp", "amqp://guest:guest@127.0.0.1:5672/"}, "exclusive"},
		{[]string{"relay", "--db", db, "--dead-letters", "--nats", natsURL}, "only work on the database"},
		{[]string{"relay", "--db", db, "--redrive", "x"}, "give sequence numbers"},
		{[]string{"relay", "--db", db, "--nats", natsURL, "--lease", "10ms"}, "too short"},
		{[]string{"relay", "--db", db, "--nats", natsURL, "--retention", "0s"}, "--retention 0"},
	} {
		code, _, errOut := runIdem(t, t.TempDir(), nil, c.args...)
		if code != exitUsage || !strings.Contains(errOut, c.want) {
			t.Errorf("idem %q: exit %d %q; want 2 and %q", c.args, code, errOut, c.want)
		}
	}
}

// TestRelayMetrics: `idem relay --metrics-addr` serves the relay's metrics
// (idemprom.Outbox), and SIGINT stops it cleanly (exit 0).
func TestRelayMetrics(t *testing.T) {
	natsURL := testenv.NATSURL(t)
	db := newPostgresDatabase(t)
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	subject := "metrics." + cliRandHex(4) + ".created"
	testStream(t, js, subject)
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ob, err := pgoutbox.New(pool, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		for i := range 2 {
			if err := ob.Enqueue(ctx, tx, outbox.Message{ID: fmt.Sprintf("m-%d", i), Subject: subject, Payload: []byte(`{}`)}); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	out := &tailBuffer{}
	addr := closedPort(t)
	p := startProc(t, out, nil, idemBin, "relay", "--db", db, "--nats", natsURL, "--metrics-addr", addr, "--poll", "50ms")
	deadline := time.Now().Add(30 * time.Second)
	for {
		body := ""
		if resp, err := http.Get("http://" + addr + "/metrics"); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = string(b)
		}
		if strings.Contains(body, "idem_outbox_published_total 2") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/metrics does not count 2 publications after 30 s:\n%s\noutput:\n%s", body, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
	p.interrupt(t)
	if code := p.cmd.ProcessState.ExitCode(); code != 0 || !strings.Contains(out.String(), "interrupted (SIGINT or SIGTERM); stopped") {
		t.Errorf("after SIGINT: exit %d, output:\n%s", code, out)
	}
}

// TestDemoEventsSubjectUsage: an --events-subject the relay could never
// publish to (an empty token, a wildcard, a control character, a reserved
// $JS./$SYS./$KV./$O./_INBOX. subject) is a usage
// error, not a demo whose every event is dead-lettered, or whose every order
// fails at Enqueue.
func TestDemoEventsSubjectUsage(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, subject := range []string{"", "orders.", ".orders", "orders..created", "orders.*", "orders.>", "orders created", "orders\ncreated", "orders\x7fcreated", "$JS.API.STREAM.DELETE.ORDERS", "$SYS.REQ.SERVER.PING", "$KV.b.k", "$O.b.C.x", "_INBOX.abc"} {
		code, _, stderr := runIdem(t, dir, nil, "demo", "--events", "nats://127.0.0.1:4222", "--events-subject", subject)
		if code != 2 || !strings.Contains(stderr, "--events-subject") {
			t.Errorf("--events-subject %q: exit %d, stderr %q; want a usage error (2)", subject, code, stderr)
		}
	}
}

// TestDemoEventIDsKeyedAndUnkeyed: with --require-key=false, an order made
// without a key has an event ID derived from its order id; one made with a
// key, from the key. A client whose key happens to be "order:" and the id
// of an earlier un-keyed order must not get that order's event ID: the
// stream's duplicate window (and the worker's dedupe) would drop its event.
func TestDemoEventIDsKeyedAndUnkeyed(t *testing.T) {
	natsURL := testenv.NATSURL(t)
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	subject := "demo." + cliRandHex(4) + ".created"
	stream := eventsStreamName(subject)
	defer func() { _ = js.DeleteStream(context.Background(), stream) }()
	dir := t.TempDir()
	d := startDemo(t, dir, nil, "--db", "sqlite:"+filepath.Join(dir, "demo.db"), "--metrics-addr", "", "--require-key=false", "--events", natsURL, "--events-subject", subject)
	a := sendHTTP(t, "POST", d.URL+"/orders", "t1", "", `{"cart_id":"c_unkeyed","total_cents":1}`)
	if a.Status != 201 {
		t.Fatalf("un-keyed POST: %d %s", a.Status, a.Body)
	}
	first := a.order(t)
	b := sendHTTP(t, "POST", d.URL+"/orders", "t1", "order:"+first.ID, `{"cart_id":"c_keyed","total_cents":2}`)
	if b.Status != 201 || b.order(t).ID == first.ID {
		t.Fatalf("keyed POST: %d %s", b.Status, b.Body)
	}
	ctx := context.Background()
	var info *jetstream.StreamInfo
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		s, err := js.Stream(ctx, stream)
		if err == nil {
			if info, err = s.Info(ctx); err == nil && info.State.Msgs >= 2 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the stream holds %+v after 15 s, want the 2 orders' events (one was dropped as a duplicate of the other?)", info)
		}
	}
	if code := d.stop(t); code != 0 {
		t.Errorf("the demo exited %d", code)
	}
	events := readStream(t, js, stream)
	if len(events) != 2 || events[0].msgID == events[1].msgID {
		t.Fatalf("events %+v: want two, under two IDs", events)
	}
}
