package natsjs_test

import (
	"bufio"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/mysqlstore/mysqloutbox"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/natsjs"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

// db is an outbox on one of the databases that allow several relays.
type db struct {
	src     outbox.Source
	enqueue func(ctx context.Context, msgs ...outbox.Message) error
	// unpublished returns which of ids are not marked published.
	unpublished func(ids []string) map[string]bool
}

func openDB(t *testing.T, kind, table string) *db {
	t.Helper()
	ctx := context.Background()
	switch kind {
	case "postgres":
		pool, err := pgxpool.New(ctx, testenv.PostgresURL(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		if err := o.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		return &db{src: o,
			enqueue: func(ctx context.Context, msgs ...outbox.Message) error {
				tx, err := pool.Begin(ctx)
				if err != nil {
					return err
				}
				defer func() { _ = tx.Rollback(ctx) }()
				for _, m := range msgs {
					if err := o.Enqueue(ctx, tx, m); err != nil {
						return err
					}
				}
				return tx.Commit(ctx)
			},
			unpublished: func(ids []string) map[string]bool {
				rows, err := pool.Query(ctx, "SELECT id FROM "+o.Table()+" WHERE published_at IS NULL AND id = ANY($1)", ids)
				if err != nil {
					t.Fatal(err)
				}
				defer rows.Close()
				out := map[string]bool{}
				for rows.Next() {
					var id string
					_ = rows.Scan(&id)
					out[id] = true
				}
				return out
			},
		}
	case "mysql":
		sdb, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
		if err != nil {
			t.Fatal(err)
		}
		sdb.SetMaxOpenConns(8)
		t.Cleanup(func() { _ = sdb.Close() })
		o, err := mysqloutbox.New(sdb, &mysqloutbox.Config{Table: table})
		if err != nil {
			t.Fatal(err)
		}
		if err := o.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		return &db{src: o,
			enqueue: func(ctx context.Context, msgs ...outbox.Message) error {
				tx, err := sdb.BeginTx(ctx, nil)
				if err != nil {
					return err
				}
				defer func() { _ = tx.Rollback() }()
				for _, m := range msgs {
					if err := o.Enqueue(ctx, tx, m); err != nil {
						return err
					}
				}
				return tx.Commit()
			},
			unpublished: func(ids []string) map[string]bool {
				out := map[string]bool{}
				for _, id := range ids {
					var n int
					if err := sdb.QueryRow("SELECT COUNT(*) FROM "+o.Table()+" WHERE published_at IS NULL AND id = ?", id).Scan(&n); err != nil {
						t.Fatal(err)
					}
					if n > 0 {
						out[id] = true
					}
				}
				return out
			},
		}
	}
	t.Fatalf("unknown database %s", kind)
	return nil
}

// freshTable returns a table name for kind, dropped (with its dead-letter
// and lock tables) when t ends.
func freshTable(t *testing.T, kind string) string {
	t.Helper()
	switch kind {
	case "postgres":
		_, schema := pgSchema(t)
		return schema + ".outbox"
	default:
		table := "outbox_" + randHex(5)
		t.Cleanup(func() {
			sdb, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
			if err == nil {
				_, _ = sdb.Exec("DROP TABLE IF EXISTS " + table + ", " + table + "_dead, " + table + "_locks")
				_ = sdb.Close()
			}
		})
		return table
	}
}

const (
	envRelayChild = "OUTBOX_NATSJS_RELAY_CHILD"
	relayLine     = "OUTBOX_RELAY "
	spanLine      = "OUTBOX_SPAN "
	envRelayLease = "OUTBOX_NATSJS_RELAY_LEASE"
	envRelayStart = "OUTBOX_NATSJS_RELAY_START"
)

// TestRelayChild is the relay process TestRelayKilled SIGKILLs: it
// publishes, printing each message's ID once the stream confirmed it, before
// the relay marks it.
func TestRelayChild(t *testing.T) {
	spec := os.Getenv(envRelayChild)
	if spec == "" {
		t.Skip("the child process of TestRelayKilled")
	}
	kind, table, _ := strings.Cut(spec, " ")
	d := openDB(t, kind, table)
	nc, err := nats.Connect(testenv.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	pub := natsjs.NewPublisher(js)
	var mu sync.Mutex
	w := bufio.NewWriter(os.Stdout)
	say := func(line string) {
		mu.Lock()
		fmt.Fprintln(w, line)
		_ = w.Flush()
		mu.Unlock()
	}
	lease := time.Second
	if v, err := time.ParseDuration(os.Getenv(envRelayLease)); err == nil {
		lease = v
	}
	if at, err := strconv.ParseInt(os.Getenv(envRelayStart), 10, 64); err == nil {
		time.Sleep(time.Until(time.Unix(0, at))) // all relays start at this moment
	}
	r := &outbox.Relay{Source: d.src, Owner: "child-" + strconv.Itoa(os.Getpid()), BatchSize: 25, Concurrency: 4,
		LeaseDuration: lease, PollInterval: 10 * time.Millisecond,
		Publisher: outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
			say(fmt.Sprint(spanLine, "B ", m.ID, " ", time.Now().UnixNano()))
			time.Sleep(time.Duration(1+rand.IntN(3)) * time.Millisecond)
			err := pub.Publish(ctx, m)
			say(fmt.Sprint(spanLine, "E ", m.ID, " ", time.Now().UnixNano()))
			if err != nil {
				return err
			}
			say(relayLine + m.ID)
			return nil
		})}
	_ = r.Run(context.Background())
}

// TestRelayKilled: relay processes are SIGKILLed mid-batch, again and again
// (IDEM_KILL_POINTS times, 3 by default); then two relays launched at once
// drain the outbox. Every message is on the stream exactly once, each
// partition in enqueue order; the messages a killed relay had published but
// not marked were published again (with the same ID, so the stream's
// duplicate window dropped the copy) after their lease lapsed.
func TestRelayKilled(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and kills relay processes")
	}
	points := 3
	if v, err := strconv.Atoi(os.Getenv("IDEM_KILL_POINTS")); err == nil && v > 0 {
		points = v
	}
	for _, kind := range []string{"postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) { testRelayKilled(t, kind, points) })
	}
}

func testRelayKilled(t *testing.T, kind string, points int) {
	ctx := context.Background()
	table := freshTable(t, kind)
	d := openDB(t, kind, table)
	b := newBroker(t, jetstream.StreamConfig{Duplicates: 10 * time.Minute})
	const n, partitions = 600, 20
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, outbox.Message{ID: fmt.Sprintf("m%05d", i), Subject: b.subject + ".orders", Payload: []byte(strconv.Itoa(i)), PartitionKey: fmt.Sprint("p", i%partitions)})
	}
	for i := 0; i < n; i += 100 {
		if err := d.enqueue(ctx, msgs[i:i+100]...); err != nil {
			t.Fatal(err)
		}
	}
	var killedUnmarked []string
	unmarkedAt := map[string]int{}    // ID -> the kill that left it unmarked
	publishedBy := map[string][]int{} // ID -> the children that published it
	childPublished := 0
	for k := range points {
		cmd := exec.Command(os.Args[0], "-test.run=^TestRelayChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), envRelayChild+"="+kind+" "+table)
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		var ids []string
		sc := bufio.NewScanner(out)
		want := 5 + rand.IntN(20) // mid-batch: batches are 25
		for len(ids) < want && sc.Scan() {
			if id, ok := strings.CutPrefix(sc.Text(), relayLine); ok {
				ids = append(ids, id)
			}
		}
		_ = cmd.Process.Kill()
		for sc.Scan() { // what it printed before it died
			if id, ok := strings.CutPrefix(sc.Text(), relayLine); ok {
				ids = append(ids, id)
			}
		}
		_ = cmd.Wait()
		// A mark the child sent just before it died may still commit on
		// the server: let it, before asking what is unmarked.
		time.Sleep(300 * time.Millisecond)
		if len(ids) < want {
			t.Fatalf("kill %d: the relay child published %d messages before it exited", k, len(ids))
		}
		childPublished += len(ids)
		for _, id := range ids {
			publishedBy[id] = append(publishedBy[id], k)
		}
		for id := range d.unpublished(ids) {
			killedUnmarked = append(killedUnmarked, id)
			unmarkedAt[id] = k
		}
	}
	if len(killedUnmarked) == 0 {
		t.Fatalf("%d kills left no published-but-unmarked message: no kill landed mid-batch", points)
	}
	// Two relays, launched at the same moment, finish the work.
	var mu sync.Mutex
	again := map[string]int{}
	pub := natsjs.NewPublisher(b.js)
	rctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 2 {
		r := &outbox.Relay{Source: d.src, Owner: fmt.Sprint("survivor-", i), BatchSize: 25, LeaseDuration: time.Second, PollInterval: 10 * time.Millisecond,
			Publisher: outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
				err := pub.Publish(ctx, m)
				if err == nil {
					mu.Lock()
					again[m.ID]++
					mu.Unlock()
				}
				return err
			})}
		wg.Add(1)
		go func() { defer wg.Done(); <-start; _ = r.Run(rctx) }()
	}
	close(start)
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err := d.src.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			if st.DeadLetters != 0 {
				t.Fatalf("%d dead letters", st.DeadLetters)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d messages unpublished", st.Pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	wg.Wait()
	for _, id := range killedUnmarked {
		republished := again[id] > 0
		for _, k := range publishedBy[id] {
			republished = republished || k > unmarkedAt[id]
		}
		if !republished {
			t.Fatalf("%s, published by killed relay %d but not marked, was not published again", id, unmarkedAt[id])
		}
	}
	// The stream: every message once, each partition in order.
	s, err := b.js.Stream(ctx, b.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != n {
		t.Fatalf("stream holds %d messages, want %d (one per ID)", info.State.Msgs, n)
	}
	seen := map[string]bool{}
	last := map[string]int{}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		id := m.Header.Get(jetstream.MsgIDHeader)
		i, _ := strconv.Atoi(string(m.Data))
		if seen[id] || id != fmt.Sprintf("m%05d", i) {
			t.Fatalf("stream seq %d: ID %s payload %d (seen before: %v)", seq, id, i, seen[id])
		}
		seen[id] = true
		p := fmt.Sprint("p", i%partitions)
		if l, ok := last[p]; ok && i < l {
			t.Fatalf("partition %s: message %d on the stream after %d", p, i, l)
		}
		last[p] = i
	}
	t.Logf("%s: %d kills mid-batch; the children published %d, %d of them unmarked at the kill and published again by a later relay with the same ID; stream: %d messages, partitions in order", kind, points, childPublished, len(killedUnmarked), info.State.Msgs)
}

// TestBrokerOutage: the relay's connection to NATS is cut every 20 ms for
// 2 s (no publication nor reconnection survives), then left alone: every
// message reaches the stream once, none is dead-lettered, no operator; the
// backoff is bounded by MaxBackoff.
func TestBrokerOutage(t *testing.T) {
	ctx := context.Background()
	d := openDB(t, "postgres", freshTable(t, "postgres"))
	b := newBroker(t, jetstream.StreamConfig{})
	u, _ := url.Parse(testenv.NATSURL(t))
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "4222")
	}
	proxy, err := faults.Listen(host)
	if err != nil {
		t.Fatal(err)
	}
	defer proxy.Close()
	pub, err := natsjs.Dial("nats://"+proxy.Addr(), nats.ReconnectWait(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer pub.Close()
	const n = 300
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, outbox.Message{ID: fmt.Sprint("m", i), Subject: b.subject + ".x", Payload: []byte("x"), PartitionKey: fmt.Sprint("p", i%10)})
	}
	obs := &failures{}
	r := &outbox.Relay{Source: d.src, Publisher: pub, Observer: obs, PollInterval: 10 * time.Millisecond,
		PublishTimeout: 200 * time.Millisecond, MinBackoff: 10 * time.Millisecond, MaxBackoff: 300 * time.Millisecond}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	stop := proxy.CutEvery(20 * time.Millisecond)
	if err := d.enqueue(ctx, msgs[:n/2]...); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if err := d.enqueue(ctx, msgs[n/2:]...); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	stop()
	recovered := time.Now()
	for {
		st, err := d.src.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			if st.DeadLetters != 0 {
				t.Fatalf("the outage dead-lettered %d messages", st.DeadLetters)
			}
			break
		}
		if time.Since(recovered) > 30*time.Second {
			t.Fatalf("%d unpublished 30 s after the broker came back", st.Pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
	took := time.Since(recovered)
	cancel()
	<-done
	got, count := b.messages(t)
	for _, m := range msgs {
		if count[m.ID] != 1 {
			t.Fatalf("message %s on the stream %d times", m.ID, count[m.ID])
		}
	}
	if len(got) != n || proxy.Cuts() == 0 || obs.count() == 0 {
		t.Fatalf("%d on the stream, %d cuts, %d failures", len(got), proxy.Cuts(), obs.count())
	}
	t.Logf("2 s of cuts (%d), %d publications failed and were retried; all %d messages on the stream %v after the cuts stopped", proxy.Cuts(), obs.count(), n, took.Round(time.Millisecond))
}

type failures struct {
	outbox.NopObserver
	mu sync.Mutex
	n  int
}

func (f *failures) Failed(*outbox.Stored, error, time.Duration) { f.mu.Lock(); f.n++; f.mu.Unlock() }
func (f *failures) count() int                                  { f.mu.Lock(); defer f.mu.Unlock(); return f.n }

// TestBoundsFitNATS: a message at every bound Enqueue allows (payload,
// header count, sizes, every token character in a name, UTF-8 and tabs in
// values) is accepted by a NATS server with the default max_payload and
// arrives intact; one byte more payload is refused at Enqueue; a payload the
// store accepts (raised MaxPayload) but the server does not is dead-lettered
// with the reason.
func TestBoundsFitNATS(t *testing.T) {
	ctx := context.Background()
	pool, schema := pgSchema(t)
	o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	raised, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox", MaxPayload: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	b := newBroker(t, jetstream.StreamConfig{})
	if mp := b.nc.MaxPayload(); mp != 1<<20 {
		t.Skipf("the NATS server's max_payload is %d, this test assumes the default 1 MiB", mp)
	}
	headers := map[string]string{"X-Token-!#$%&'*+-.^_`|~": "café\tüñí", "Content-Type": "application/json"}
	for i := 0; len(headers) < outbox.MaxHeaders; i++ {
		headers[fmt.Sprintf("X-H%02d", i)] = strings.Repeat("v", 200)
	}
	payload := make([]byte, outbox.DefaultMaxPayload)
	for i := range payload {
		payload[i] = byte(i) // NUL bytes included
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Enqueue(ctx, tx, outbox.Message{ID: "at-bounds", Subject: b.subject + ".big", Payload: payload, Headers: headers}); err != nil {
		t.Fatal(err)
	}
	if err := o.Enqueue(ctx, tx, outbox.Message{ID: "over", Subject: b.subject + ".big", Payload: make([]byte, outbox.DefaultMaxPayload+1)}); !errors.Is(err, outbox.ErrTooLarge) {
		t.Fatalf("a payload over the bound: %v", err)
	}
	if err := raised.Enqueue(ctx, tx, outbox.Message{ID: "too-big-for-nats", Subject: b.subject + ".big", Payload: make([]byte, 2<<20)}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	r := &outbox.Relay{Source: o, Publisher: natsjs.NewPublisher(b.js)}
	if _, err := r.PublishBatch(ctx); err != nil {
		t.Fatal(err)
	}
	got, _ := b.messages(t)
	m := got["at-bounds"]
	if m == nil || len(got) != 1 || string(m.Data) != string(payload) {
		t.Fatalf("stream: %d messages", len(got))
	}
	for k, v := range headers {
		if m.Header.Get(k) != v {
			t.Fatalf("header %s = %q, want %q", k, m.Header.Get(k), v)
		}
	}
	dead, err := o.DeadLetters(ctx, 10)
	if err != nil {
		t.Fatal(err)
	}
	if len(dead) != 1 || dead[0].ID != "too-big-for-nats" || !strings.Contains(dead[0].Reason, "max_payload") {
		t.Fatalf("dead letters %+v", dead)
	}
}

// TestClosedConnection: the connection of a Dial publisher is closed (not
// cut: closed for good, as nats.go does after its last reconnect): the next
// publications dial again, nothing is lost. Wildcard and empty-token
// subjects are dead-lettered, not retried forever.
func TestClosedConnection(t *testing.T) {
	ctx := context.Background()
	d := openDB(t, "postgres", freshTable(t, "postgres"))
	b := newBroker(t, jetstream.StreamConfig{})
	p, err := natsjs.Dial(testenv.NATSURL(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := &outbox.Relay{Source: d.src, Publisher: p, MinBackoff: time.Millisecond, MaxBackoff: 10 * time.Millisecond}
	if err := d.enqueue(ctx, outbox.Message{ID: "before", Subject: b.subject + ".x"}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.PublishBatch(ctx); err != nil {
		t.Fatal(err)
	}
	p.Close() // the connection is gone for good
	if err := d.enqueue(ctx,
		outbox.Message{ID: "after", Subject: b.subject + ".x"},
		outbox.Message{ID: "wild", Subject: b.subject + ".*"},
		outbox.Message{ID: "gap", Subject: b.subject + "..x"},
	); err != nil {
		t.Fatal(err)
	}
	for range 20 {
		if _, err := r.PublishBatch(ctx); err != nil {
			t.Fatal(err)
		}
		if st, _ := d.src.Stats(ctx); st.Pending == 0 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	st, err := d.src.Stats(ctx)
	if err != nil || st.Pending != 0 || st.DeadLetters != 2 {
		t.Fatalf("stats %+v %v", st, err)
	}
	got, _ := b.messages(t)
	if got["before"] == nil || got["after"] == nil || len(got) != 2 {
		t.Fatalf("stream %v", got)
	}
}

// TestRelayProcessesAtOnce: three relay processes on one outbox, started at
// the same instant, drain 600 messages in 20 partitions to JetStream. No
// message is in a Publish call of two processes at overlapping times (each
// process logs when its Publish begins and ends), every message reaches the
// stream once, and each partition is on the stream in enqueue order.
func TestRelayProcessesAtOnce(t *testing.T) {
	if testing.Short() {
		t.Skip("starts relay processes")
	}
	for _, kind := range []string{"postgres", "mysql"} {
		t.Run(kind, func(t *testing.T) { testRelayProcessesAtOnce(t, kind) })
	}
}

type span struct {
	proc       int
	begin, end int64
}

func testRelayProcessesAtOnce(t *testing.T, kind string) {
	ctx := context.Background()
	table := freshTable(t, kind)
	d := openDB(t, kind, table)
	b := newBroker(t, jetstream.StreamConfig{})
	const n, partitions, procs = 600, 20, 3
	var msgs []outbox.Message
	for i := range n {
		msgs = append(msgs, outbox.Message{ID: fmt.Sprintf("m%05d", i), Subject: b.subject + ".orders", Payload: []byte(strconv.Itoa(i)), PartitionKey: fmt.Sprint("p", i%partitions)})
	}
	for i := 0; i < n; i += 100 {
		if err := d.enqueue(ctx, msgs[i:i+100]...); err != nil {
			t.Fatal(err)
		}
	}
	startAt := time.Now().Add(3 * time.Second).UnixNano() // after the processes are up
	var mu sync.Mutex
	spans := map[string][]span{}
	open := map[[2]string]int64{}
	var wg sync.WaitGroup
	var cmds []*exec.Cmd
	for p := range procs {
		cmd := exec.Command(os.Args[0], "-test.run=^TestRelayChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), envRelayChild+"="+kind+" "+table, envRelayLease+"=10s", envRelayStart+"="+strconv.FormatInt(startAt, 10))
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, cmd)
		wg.Add(1)
		go func() {
			defer wg.Done()
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				rest, ok := strings.CutPrefix(sc.Text(), spanLine)
				if !ok {
					continue
				}
				f := strings.Fields(rest)
				if len(f) != 3 {
					continue
				}
				ns, _ := strconv.ParseInt(f[2], 10, 64)
				k := [2]string{strconv.Itoa(p), f[1]}
				mu.Lock()
				if f[0] == "B" {
					open[k] = ns
				} else {
					spans[f[1]] = append(spans[f[1]], span{proc: p, begin: open[k], end: ns})
					delete(open, k)
				}
				mu.Unlock()
			}
		}()
	}
	defer func() {
		for _, c := range cmds {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}()
	deadline := time.Now().Add(90 * time.Second)
	for {
		st, err := d.src.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d unpublished", st.Pending)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, c := range cmds {
		_ = c.Process.Kill()
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	byProc := map[int]int{}
	for id, ss := range spans {
		for i := range ss {
			byProc[ss[i].proc]++
			for j := range i {
				if ss[i].begin < ss[j].end && ss[j].begin < ss[i].end {
					t.Fatalf("%s was being published by processes %d and %d at once", id, ss[i].proc, ss[j].proc)
				}
			}
		}
	}
	if len(spans) != n {
		t.Fatalf("%d messages were published, want %d", len(spans), n)
	}
	if len(byProc) < 2 {
		t.Fatalf("publications by process: %v; the processes did not share the work, so the test proved nothing", byProc)
	}
	s, err := b.js.Stream(ctx, b.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != n {
		t.Fatalf("stream holds %d, want %d", info.State.Msgs, n)
	}
	last := map[int]int{}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		i, _ := strconv.Atoi(string(m.Data))
		if l, ok := last[i%partitions]; ok && i < l {
			t.Fatalf("partition p%d: %d after %d on the stream", i%partitions, i, l)
		}
		last[i%partitions] = i
	}
	t.Logf("%s: %d relay processes started at one instant; publications per process %v; no message in two Publish calls at once; stream: %d, partitions in order", kind, procs, byProc, info.State.Msgs)
}
