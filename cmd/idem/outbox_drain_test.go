package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/dbopen"
	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/orders"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// envInt reads a positive whole number from the environment, def when unset.
func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q is not a positive number", name, v)
	}
	return n
}

// testStream creates a stream of the test's own for subject and deletes it
// when the test ends.
func testStream(t *testing.T, js jetstream.JetStream, subject string) string {
	t.Helper()
	name := "T_" + strings.ToUpper(strings.ReplaceAll(subject, ".", "_"))
	if _, err := js.CreateStream(context.Background(), jetstream.StreamConfig{Name: name, Subjects: []string{subject}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), name) })
	return name
}

// streamMsgIDs returns how many messages the stream holds and how many
// distinct Nats-Msg-Id among them.
func streamMsgIDs(t *testing.T, js jetstream.JetStream, stream string) (msgs int, ids map[string]int) {
	t.Helper()
	ids = map[string]int{}
	ctx := context.Background()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for seq := info.State.FirstSeq; info.State.Msgs > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		ids[m.Header.Get(jetstream.MsgIDHeader)]++
		msgs++
	}
	return msgs, ids
}

// TestOutboxOutage: orders keep coming while the relay's broker is away —
// its connections cut, then black-holed (nothing answers) for
// IDEM_OUTAGE_SECONDS (5 in CI; 30 by hand) — and while the standalone
// `idem relay` is down for as long: nothing is lost, no operator acts (the
// relay that saw the broker outage is the same process, it recovers by
// itself; the relay restarted after its own outage picks up every message
// that waited), and the recovery time after each outage is logged.
func TestOutboxOutage(t *testing.T) {
	natsURL := testenv.NATSURL(t)
	outage := time.Duration(envInt(t, "IDEM_OUTAGE_SECONDS", 5)) * time.Second
	db := newPostgresDatabase(t)
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	subject := "outage." + cliRandHex(4) + ".created"
	stream := testStream(t, js, subject)
	host, _ := netURLHost(natsURL)
	fp, err := faults.Listen(host)
	if err != nil {
		t.Fatal(err)
	}
	defer fp.Close()

	d := startDemo(t, t.TempDir(), nil, "--metrics-addr", "", "--db", db, "--events", natsURL, "--events-subject", subject, "--events-relay=false")
	out := &tailBuffer{}
	relayArgs := []string{"relay", "--db", db, "--nats", "nats://" + fp.Addr(), "--poll", "100ms"}
	relay := startProc(t, out, nil, idemBin, relayArgs...)

	var sent atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // an order every ~20 ms, each with its own key, retried until 201
		defer wg.Done()
		client := &http.Client{Timeout: 10 * time.Second}
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(10+rand.IntN(20)) * time.Millisecond):
			}
			for {
				req, _ := http.NewRequest("POST", d.URL+"/orders", strings.NewReader(fmt.Sprintf(`{"cart_id":"c_%d","total_cents":1}`, i)))
				req.Header.Set("Authorization", "Bearer t1")
				req.Header.Set("Idempotency-Key", fmt.Sprintf("outage-%d", i))
				resp, err := client.Do(req)
				if err == nil {
					resp.Body.Close()
					if resp.StatusCode == 201 {
						sent.Add(1)
						break
					}
				}
				time.Sleep(50 * time.Millisecond)
			}
		}
	}()
	pending := func() int64 {
		code, o, e := runIdem(t, t.TempDir(), nil, "relay", "--db", db, "--stats", "--json")
		var st struct{ Pending int64 }
		if code != 0 || json.Unmarshal([]byte(o), &st) != nil {
			t.Fatalf("idem relay --stats: %d %s %s", code, o, e)
		}
		return st.Pending
	}
	// recovered waits until the outbox is empty and returns how long it took.
	recovered := func(what string) time.Duration {
		t0 := time.Now()
		for pending() > 0 {
			if time.Since(t0) > outage+2*time.Minute {
				t.Fatalf("after the %s, the outbox did not empty in %v; relay output:\n%s", what, time.Since(t0), out)
			}
			time.Sleep(100 * time.Millisecond)
		}
		return time.Since(t0)
	}
	time.Sleep(2 * time.Second)

	// 1. The broker goes away: connections cut, then nothing answers.
	fp.Hold()
	fp.Cut()
	time.Sleep(outage)
	atOutageEnd := pending()
	fp.Release()
	brokerRecovery := recovered("broker outage")

	// 2. The relay goes away for as long, then is started again.
	relay.kill()
	time.Sleep(outage)
	atRelayBack := pending()
	relay = startProc(t, out, nil, idemBin, relayArgs...)
	relayRecovery := recovered("relay outage")

	close(stop)
	wg.Wait()
	_ = recovered("last orders")
	relay.interrupt(t)
	msgs, ids := streamMsgIDs(t, js, stream)
	t.Logf("%v broker outage: %d events waited at its end, all published %v after it; %v relay outage: %d waited, all published %v after the restart; %d orders, %d messages on the stream, %d distinct IDs",
		outage, atOutageEnd, brokerRecovery.Round(time.Millisecond), outage, atRelayBack, relayRecovery.Round(time.Millisecond), sent.Load(), msgs, len(ids))
	if atOutageEnd == 0 || atRelayBack == 0 {
		t.Errorf("no event waited during an outage (%d, %d): the test did not test anything", atOutageEnd, atRelayBack)
	}
	if int64(len(ids)) != sent.Load() {
		t.Errorf("%d orders committed, %d distinct events on the stream; want one per order", sent.Load(), len(ids))
	}
	n := int64(0)
	conn := pgConnect(t, db)
	if err := conn.QueryRow(context.Background(), "SELECT count(*) FROM orders").Scan(&n); err != nil || n != sent.Load() {
		t.Errorf("%d orders in the table (%v), %d answered", n, err, sent.Load())
	}
}

// TestOutboxDrain measures how fast `idem relay` drains a backlog:
// IDEM_OUTBOX_DRAIN events (1,000 in CI; 10,000 for BENCHMARKS.md) are
// enqueued into an outbox first (PostgreSQL, SQLite, MariaDB), then the
// relay publishes them to JetStream and exits when the outbox is empty. It
// logs the rate (events/s) and the lag curve (pending messages and the age of
// the oldest, at every tenth of the run), and checks only that every event
// reached the stream once. Measured, not asserted.
func TestOutboxDrain(t *testing.T) {
	natsURL := testenv.NATSURL(t)
	n := envInt(t, "IDEM_OUTBOX_DRAIN", 1000)
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	pg := newPostgresDatabase(t)
	my, _ := newMySQLDatabase(t)
	lite := "sqlite:" + filepath.Join(t.TempDir(), "drain.db")
	for _, cfg := range []struct {
		name, db string
		flags    []string
	}{
		{"postgres-defaults", pg, nil},
		{"postgres-batch500-conc64", pg, []string{"--batch", "500", "--concurrency", "64"}},
		{"sqlite-defaults", lite, nil},
		{"mariadb-defaults", my, nil},
	} {
		t.Run(cfg.name, func(t *testing.T) { drain(t, js, cfg.db, n, cfg.flags) })
	}
}

func drain(t *testing.T, js jetstream.JetStream, db string, n int, flags []string) {
	subject := "drain." + cliRandHex(4) + ".created"
	stream := testStream(t, js, subject)
	table := "drain_" + cliRandHex(4) + "_outbox"
	ctx := context.Background()
	h, err := dbopen.Open(ctx, dbopen.Options{DB: db})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	ob, err := openOutbox(h, table)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.migrate(ctx); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	for i := 0; i < n; i += 500 {
		err := handleTx(ctx, h, func(tx orders.Tx) error {
			for j := i; j < min(i+500, n); j++ {
				m := outbox.Message{ID: fmt.Sprintf("drain-%d", j), Subject: subject,
					Payload: fmt.Appendf(nil, `{"order_id":"ord_%024d","cart_id":"c_%d","tenant":"t1","total_cents":100}`, j, j)}
				if err := ob.enqueue(ctx, tx, m); err != nil {
					return err
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	enq := time.Since(t0)
	out := &tailBuffer{}
	args := append([]string{"relay", "--db", db, "--outbox-table", table, "--nats", testenv.NATSURL(t), "--exit-when-empty", "--poll", "20ms"}, flags...)
	start := time.Now()
	relay := startProc(t, out, nil, idemBin, args...)
	type sample struct {
		at      time.Duration
		pending int64
		oldest  time.Duration
	}
	var curve []sample
	for done := false; !done; {
		select {
		case <-relay.done:
			done = true
		case <-time.After(50 * time.Millisecond):
		}
		st, err := ob.source.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		curve = append(curve, sample{time.Since(start), st.Pending, st.OldestPending})
		if time.Since(start) > 5*time.Minute {
			relay.kill()
			t.Fatalf("the relay did not drain %d events in 5 min; output:\n%s", n, out)
		}
	}
	took := time.Since(start)
	if code := relay.cmd.ProcessState.ExitCode(); code != 0 {
		t.Fatalf("idem relay exited %d:\n%s", code, out)
	}
	// From the first sample that saw the backlog shrink (the relay's start
	// and connection excluded) to the first that saw it empty.
	first, last := took, took
	for _, c := range curve {
		if c.pending < int64(n) && first == took {
			first = c.at
		}
		if c.pending == 0 {
			last = c.at
			break
		}
	}
	var b strings.Builder
	step := max(1, len(curve)/10)
	for i := 0; i < len(curve); i += step {
		fmt.Fprintf(&b, "  t=%6.2fs pending=%6d oldest=%v\n", curve[i].at.Seconds(), curve[i].pending, curve[i].oldest.Round(time.Millisecond))
	}
	end := curve[len(curve)-1]
	fmt.Fprintf(&b, "  t=%6.2fs pending=%6d oldest=%v\n", end.at.Seconds(), end.pending, end.oldest.Round(time.Millisecond))
	t.Logf("%d events enqueued in %v; idem relay %v drained them in %v after its first publication (%v from its start to its exit): %.0f events/s\nlag curve:\n%s",
		n, enq.Round(time.Millisecond), flags, (last - first).Round(time.Millisecond), took.Round(time.Millisecond), float64(n)/(last-first).Seconds(), b.String())
	msgs, ids := streamMsgIDs(t, js, stream)
	if len(ids) != n || msgs != n {
		t.Errorf("%d messages with %d distinct IDs on the stream; want %d once each", msgs, len(ids), n)
	}
}

// handleTx runs fn in a transaction of h's database.
func handleTx(ctx context.Context, h *dbopen.Handle, fn func(tx orders.Tx) error) error {
	if h.Pool != nil {
		return pgx.BeginFunc(ctx, h.Pool, func(tx pgx.Tx) error { return fn(orders.Tx{Pgx: tx}) })
	}
	tx, err := h.SQL.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := fn(orders.Tx{SQL: tx}); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}
