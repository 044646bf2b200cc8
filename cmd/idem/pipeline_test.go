package main

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The pipeline proof of the transactional outbox (issue 28): HTTP key →
// the order's transaction with its outbox message → the relay → JetStream →
// the consumer's dedupe, with every process crashing.
//
// IDEM_PIPELINE_ORDERS sets the number of orders (default 120 in CI; 1000
// by hand). IDEM_PIPELINE_BROKEN runs a deliberately broken variant, which
// must make the test FAIL:
//
//	before-commit  the demo publishes from the handler, before the commit
//	after-commit   the demo publishes after the commit, without an outbox
//	unstable-id    the demo's relay republishes under another ID
//	no-dedupe      the worker applies every delivery, without the dedupe
//
// (built with -tags idem_broken_outbox / idem_broken_worker).

// pipelineOrders is the number of orders of one pipeline run.
func pipelineOrders(t *testing.T) int {
	n := 120
	if v := os.Getenv("IDEM_PIPELINE_ORDERS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			t.Fatalf("IDEM_PIPELINE_ORDERS=%q is not a positive number", v)
		}
	}
	return n
}

// pipelineSpan is about how long the orders of one run take:
// IDEM_PIPELINE_SECONDS, default 10.
func pipelineSpan(t *testing.T) time.Duration {
	s := 10
	if v := os.Getenv("IDEM_PIPELINE_SECONDS"); v != "" {
		var err error
		if s, err = strconv.Atoi(v); err != nil || s < 1 {
			t.Fatalf("IDEM_PIPELINE_SECONDS=%q is not a positive number", v)
		}
	}
	return time.Duration(s) * time.Second
}

var (
	buildOnce   sync.Map // tags → *buildResult
	workerMu    sync.Mutex
	pipelineDir string
)

type buildResult struct {
	once sync.Once
	path string
	err  error
}

// buildBinary builds pkg (relative to cmd/idem) with tags, once per test
// binary, and returns its path.
func buildBinary(t *testing.T, name, pkg, tags string) string {
	t.Helper()
	v, _ := buildOnce.LoadOrStore(name+"|"+tags, &buildResult{})
	b := v.(*buildResult)
	b.once.Do(func() {
		workerMu.Lock()
		if pipelineDir == "" {
			pipelineDir, b.err = os.MkdirTemp("", "idem-pipeline-")
		}
		dir := pipelineDir
		workerMu.Unlock()
		if b.err != nil {
			return
		}
		b.path = filepath.Join(dir, name+"-"+strings.ReplaceAll(tags, ",", "_"))
		args := []string{"build", "-o", b.path}
		if tags != "" {
			args = append(args, "-tags", tags)
		}
		cmd := exec.Command("go", append(args, pkg)...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			b.err = fmt.Errorf("go build %s: %v\n%s", pkg, err, out)
		}
	})
	if b.err != nil {
		t.Fatal(b.err)
	}
	return b.path
}

// proc is a process the chaos loops start and SIGKILL, its output kept (the
// last 64 KiB) for the failure messages.
type proc struct {
	cmd  *exec.Cmd
	out  *tailBuffer
	done chan struct{}
}

type tailBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > 64<<10 {
		t.b = append([]byte(nil), t.b[len(t.b)-(64<<10):]...)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return string(t.b)
}

func startProc(t *testing.T, out *tailBuffer, env []string, bin string, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(bin, args...), out: out, done: make(chan struct{})}
	p.cmd.Env = cliEnv(append(env, "IDEM_EXIT_WITH_PARENT=true")...)
	p.cmd.Stdout, p.cmd.Stderr = out, out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	go func() { _ = p.cmd.Wait(); close(p.done) }()
	return p
}

func (p *proc) kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

func (p *proc) interrupt(t *testing.T) {
	_ = p.cmd.Process.Signal(syscall.SIGINT)
	select {
	case <-p.done:
	case <-time.After(40 * time.Second):
		t.Errorf("%s did not stop within 40 s of SIGINT", p.cmd.Path)
		p.kill()
	}
}

// chaos restarts a process for ever, SIGKILLing each after a random time in
// [min, max), until stop is called; the last one keeps running, and is
// returned by stop.
func chaos(t *testing.T, minLife, maxLife time.Duration, start func() *proc) (stop func() *proc, kills *atomic.Int64) {
	kills = new(atomic.Int64)
	quit := make(chan struct{})
	last := make(chan *proc, 1)
	go func() {
		for {
			p := start()
			life := minLife + rand.N(maxLife-minLife)
			select {
			case <-quit:
				last <- p
				return
			case <-time.After(life):
				p.kill()
				kills.Add(1)
			case <-p.done:
				// It died on its own: start again (the output says why).
			}
		}
	}()
	var once sync.Once
	var p *proc
	return func() *proc {
		once.Do(func() {
			close(quit)
			p = <-last
		})
		return p
	}, kills
}

// pipelineClient sends the orders, each with its own key, retrying each until
// it is answered 201 (executed or replayed), and returns the order id each
// key was answered with.
//
// The orders are spread over about span (8 clients, each waiting a random
// time between its orders), so that the processes are killed many times
// while orders are being made.
func pipelineClient(t *testing.T, ctx context.Context, base string, n int, span time.Duration) (ids map[int]string, sent, retries, replays int64) {
	pace := 8 * span / time.Duration(n) // each client's mean time per order
	var mu sync.Mutex
	ids = map[int]string{}
	var nSent, nRetries, nReplays atomic.Int64
	work := make(chan int)
	var wg sync.WaitGroup
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	post := func(i int) (int, string, bool, error) {
		body := fmt.Sprintf(`{"cart_id":"c_%d","total_cents":%d}`, i, 100+i)
		req, _ := http.NewRequestWithContext(ctx, "POST", base+"/orders", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer "+pipelineTenant(i))
		req.Header.Set("Idempotency-Key", fmt.Sprintf("pipe-%d", i))
		req.Header.Set("Content-Type", "application/json")
		nSent.Add(1)
		resp, err := client.Do(req)
		if err != nil {
			return 0, "", false, err
		}
		defer resp.Body.Close()
		data, _ := io.ReadAll(resp.Body)
		var o struct{ ID string }
		_ = json.Unmarshal(data, &o)
		if resp.StatusCode == 201 && o.ID == "" {
			return 0, "", false, fmt.Errorf("201 without an order id: %s", data)
		}
		return resp.StatusCode, o.ID, resp.Header.Get("Idempotent-Replayed") == "true", nil
	}
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				time.Sleep(rand.N(2*pace + 1))
				var id string
				for ctx.Err() == nil {
					code, got, replayed, err := post(i)
					if err == nil && code == 201 {
						id = got
						if replayed {
							nReplays.Add(1)
						}
						break
					}
					if err == nil && code != 503 && code != 500 && code != 409 {
						t.Errorf("order %d: answered %d; want 201 or a retryable 5xx/409", i, code)
						break
					}
					nRetries.Add(1)
					time.Sleep(time.Duration(20+rand.IntN(60)) * time.Millisecond)
				}
				if id == "" {
					continue
				}
				// One client in three retries anyway (its answer was "lost"):
				// it must get the same order, replayed.
				if rand.IntN(3) == 0 {
					for ctx.Err() == nil {
						code, again, replayed, err := post(i)
						if err == nil && code == 201 {
							if again != id || !replayed {
								t.Errorf("order %d: retry answered %s (replayed %v); want %s replayed", i, again, replayed, id)
							}
							nReplays.Add(1)
							break
						}
						nRetries.Add(1)
						time.Sleep(time.Duration(20+rand.IntN(60)) * time.Millisecond)
					}
				}
				mu.Lock()
				ids[i] = id
				mu.Unlock()
			}
		}()
	}
	for i := range n {
		work <- i
	}
	close(work)
	wg.Wait()
	return ids, nSent.Load(), nRetries.Load(), nReplays.Load()
}

func pipelineTenant(i int) string { return fmt.Sprintf("t%d", i%3) }

// streamEvent is one message of the events stream.
type streamEvent struct {
	msgID  string
	header string // the Tenant header
	orderEvent
}

// readStream returns every message of stream.
func readStream(t *testing.T, js jetstream.JetStream, stream string) []streamEvent {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []streamEvent
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("stream %s seq %d: %v", stream, seq, err)
		}
		e := streamEvent{msgID: m.Header.Get(jetstream.MsgIDHeader), header: m.Header.Get(eventTenantHeader)}
		if err := json.Unmarshal(m.Data, &e.orderEvent); err != nil {
			t.Errorf("stream %s seq %d: not an order event: %q", stream, seq, m.Data)
		}
		out = append(out, e)
	}
	return out
}

// committedOrder is one row of the demo's orders table.
type committedOrder struct{ id, tenant, cart string }

// pipelineFindings checks the pipeline's three properties and returns what
// breaks them (empty when all hold):
//  1. every committed order has its event on the stream, possibly more than
//     once, always with one message ID (and no two orders share one);
//  2. no event exists for an order that did not commit;
//  3. the consumer applied each committed order's effect exactly once.
func pipelineFindings(committed []committedOrder, events []streamEvent, applied map[string]int) []string {
	var f []string
	byID := map[string]committedOrder{}
	for _, o := range committed {
		byID[o.id] = o
	}
	msgIDs := map[string]map[string]bool{} // order → its message IDs
	owner := map[string]string{}           // message ID → order
	orphans := 0
	for _, e := range events {
		o, ok := byID[e.OrderID]
		if !ok {
			orphans++
			if orphans <= 5 {
				f = append(f, fmt.Sprintf("event %s names order %s, which did not commit", e.msgID, e.OrderID))
			}
			continue
		}
		if e.Tenant != o.tenant || e.header != o.tenant || e.CartID != o.cart {
			f = append(f, fmt.Sprintf("event of order %s: tenant %q (header %q), cart %q; the order is tenant %q, cart %q", o.id, e.Tenant, e.header, e.CartID, o.tenant, o.cart))
		}
		if msgIDs[o.id] == nil {
			msgIDs[o.id] = map[string]bool{}
		}
		msgIDs[o.id][e.msgID] = true
		if prev, ok := owner[e.msgID]; ok && prev != o.id {
			f = append(f, fmt.Sprintf("message ID %s carries the events of two orders, %s and %s", e.msgID, prev, o.id))
		}
		owner[e.msgID] = o.id
	}
	if orphans > 5 {
		f = append(f, fmt.Sprintf("… %d events in all name orders that did not commit", orphans))
	}
	missing, unstable, wrongApplied := 0, 0, 0
	for _, o := range committed {
		switch n := len(msgIDs[o.id]); {
		case n == 0:
			missing++
			if missing <= 5 {
				f = append(f, fmt.Sprintf("committed order %s has no event on the stream", o.id))
			}
		case n > 1:
			unstable++
			if unstable <= 5 {
				f = append(f, fmt.Sprintf("order %s's event was published under %d message IDs", o.id, n))
			}
		}
		if applied[o.id] != 1 {
			wrongApplied++
			if wrongApplied <= 5 {
				f = append(f, fmt.Sprintf("the consumer applied order %s's event %d times; want exactly once", o.id, applied[o.id]))
			}
		}
	}
	if missing > 5 {
		f = append(f, fmt.Sprintf("… %d committed orders in all have no event", missing))
	}
	if wrongApplied > 5 {
		f = append(f, fmt.Sprintf("… %d orders in all were not applied exactly once", wrongApplied))
	}
	for id, n := range applied {
		if _, ok := byID[id]; !ok {
			f = append(f, fmt.Sprintf("the consumer applied %d effects for order %s, which did not commit", n, id))
		}
	}
	return f
}

// TestPipelineFindings: each property's check fails on a pipeline that
// breaks it, and passes on one that holds (the checks of TestOutboxPipeline
// are not vacuous).
func TestPipelineFindings(t *testing.T) {
	committed := []committedOrder{{"o1", "t1", "c1"}, {"o2", "t2", "c2"}}
	ev := func(id, order, tenant, cart string) streamEvent {
		return streamEvent{msgID: id, header: tenant, orderEvent: orderEvent{OrderID: order, Tenant: tenant, CartID: cart}}
	}
	good := []streamEvent{ev("m1", "o1", "t1", "c1"), ev("m2", "o2", "t2", "c2"), ev("m1", "o1", "t1", "c1")}
	once := map[string]int{"o1": 1, "o2": 1}
	if f := pipelineFindings(committed, good, once); len(f) != 0 {
		t.Fatalf("a sound pipeline (one republication) has findings: %q", f)
	}
	for name, c := range map[string]struct {
		events  []streamEvent
		applied map[string]int
		want    string
	}{
		"lost event":          {good[:1], once, "has no event"},
		"uncommitted event":   {append(good, ev("m3", "o3", "t1", "c3")), once, "did not commit"},
		"unstable id":         {append(good, ev("m9", "o1", "t1", "c1")), once, "under 2 message IDs"},
		"shared id":           {[]streamEvent{ev("m1", "o1", "t1", "c1"), ev("m1", "o2", "t2", "c2")}, once, "two orders"},
		"wrong tenant":        {[]streamEvent{ev("m1", "o1", "t2", "c1"), good[1]}, once, "tenant"},
		"applied twice":       {good, map[string]int{"o1": 2, "o2": 1}, "2 times"},
		"not applied":         {good, map[string]int{"o1": 1}, "0 times"},
		"applied uncommitted": {good, map[string]int{"o1": 1, "o2": 1, "o3": 1}, "did not commit"},
	} {
		f := pipelineFindings(committed, c.events, c.applied)
		if !strings.Contains(strings.Join(f, "\n"), c.want) {
			t.Errorf("%s: findings %q lack %q", name, f, c.want)
		}
	}
}

// pipelineRun is one pipeline set-up: where the demo keeps its orders and
// where the worker applies its effects.
type pipelineRun struct {
	name     string
	demoDB   string // --db of the demo
	workerDB string // -db of the worker
	// committed reads the demo's orders table.
	committed func(t *testing.T) []committedOrder
	// applied reads the worker's fulfilments.
	applied func(t *testing.T) map[string]int
	// standaloneRelay: the demo only enqueues (--events-relay=false) and an
	// `idem relay` process, SIGKILLed at random too, publishes.
	standaloneRelay bool
	// amqp: the standalone relay publishes to RabbitMQ (a queue named as the
	// subject, on the default exchange) instead of JetStream; the consumer is
	// then amqpWorker (consumer/amqp), in the test process, its connection
	// cut at random, instead of orders-worker.
	amqp bool
}

// TestOutboxPipeline is the proof of issue 28: N keyed orders, each retried
// until answered (and one in three retried again after its answer), sent to
// `idem demo --events` while the demo (or the standalone `idem relay`) is
// SIGKILLed and restarted every fraction of a second, the relay's NATS
// connections are cut and black-holed by a fault proxy, and the worker
// (examples/orders-worker -events) is SIGKILLed too. Afterwards: every
// committed order has its event on the stream (possibly more than once,
// always under one ID), no event exists for an order that did not commit,
// and the worker applied each order's effect exactly once (its fulfilments
// table). The set-ups: the demo on PostgreSQL, SQLite or MariaDB, each with
// the worker on the other kind of database; the standalone relay on
// PostgreSQL with the worker on PostgreSQL; the standalone relay to
// RabbitMQ.
func TestOutboxPipeline(t *testing.T) {
	natsURL := testenv.NATSURL(t)
	runs := []func(t *testing.T) pipelineRun{
		func(t *testing.T) pipelineRun {
			db := newPostgresDatabase(t)
			wdb := filepath.Join(t.TempDir(), "fulfilments.db")
			return pipelineRun{name: "demo-postgres-worker-sqlite", demoDB: db, workerDB: wdb,
				committed: func(t *testing.T) []committedOrder { return pgCommitted(t, db) },
				applied:   func(t *testing.T) map[string]int { return sqliteApplied(t, wdb) }}
		},
		func(t *testing.T) pipelineRun {
			path := filepath.Join(t.TempDir(), "demo.db")
			wdb := newPostgresDatabase(t)
			return pipelineRun{name: "demo-sqlite-worker-postgres", demoDB: "sqlite:" + path, workerDB: wdb,
				committed: func(t *testing.T) []committedOrder { return sqliteCommitted(t, path) },
				applied:   func(t *testing.T) map[string]int { return pgApplied(t, wdb) }}
		},
		func(t *testing.T) pipelineRun {
			url, mdb := newMySQLDatabase(t)
			wdb := filepath.Join(t.TempDir(), "fulfilments.db")
			return pipelineRun{name: "demo-mariadb-worker-sqlite", demoDB: url, workerDB: wdb,
				committed: func(t *testing.T) []committedOrder { return sqlCommitted(t, mdb) },
				applied:   func(t *testing.T) map[string]int { return sqliteApplied(t, wdb) }}
		},
		func(t *testing.T) pipelineRun {
			db := newPostgresDatabase(t)
			wdb := newPostgresDatabase(t)
			return pipelineRun{name: "relay-postgres-worker-postgres", demoDB: db, workerDB: wdb, standaloneRelay: true,
				committed: func(t *testing.T) []committedOrder { return pgCommitted(t, db) },
				applied:   func(t *testing.T) map[string]int { return pgApplied(t, wdb) }}
		},
	}
	runs = append(runs, func(t *testing.T) pipelineRun {
		db := newPostgresDatabase(t)
		return pipelineRun{name: "relay-postgres-rabbitmq", demoDB: db, standaloneRelay: true, amqp: true,
			committed: func(t *testing.T) []committedOrder { return pgCommitted(t, db) }}
	})
	for _, mk := range runs {
		r := mk(t)
		t.Run(r.name, func(t *testing.T) { runPipeline(t, natsURL, r) })
	}
}

func runPipeline(t *testing.T, natsURL string, r pipelineRun) {
	n := pipelineOrders(t)
	broken := os.Getenv("IDEM_PIPELINE_BROKEN")
	demoTags, workerTags := "", ""
	switch broken {
	case "":
	case "before-commit", "after-commit", "unstable-id":
		demoTags = "idem_broken_outbox"
	case "no-dedupe":
		workerTags = "idem_broken_worker"
	default:
		t.Fatalf("IDEM_PIPELINE_BROKEN=%q: use before-commit, after-commit, unstable-id or no-dedupe", broken)
	}
	if demoTags != "" && r.standaloneRelay {
		t.Skipf("IDEM_PIPELINE_BROKEN=%s breaks the demo's own publishing; this set-up runs the standalone relay", broken)
	}
	idem := idemBin
	if demoTags != "" {
		idem = buildBinary(t, "idem", ".", demoTags)
	}
	worker := buildBinary(t, "orders-worker", "../../examples/orders-worker", workerTags)

	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	sfx := cliRandHex(4)
	subject, stream := "pipeline."+sfx+".created", "PIPELINE_"+strings.ToUpper(sfx)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	// A duplicate window of 1 s (JetStream's default is 2 min), so that
	// republications land on the stream as well and the consumer's dedupe,
	// not the broker's, is what the proof relies on.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}, Duplicates: time.Second}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })

	u, _ := netURLHost(natsURL)
	var amqpURL string
	var aw *amqpWorker
	if r.amqp {
		amqpURL = testenv.AMQPURL(t)
		u = amqpHost(t, amqpURL)
		aw = startAMQPWorker(t, amqpURL, subject, broken != "no-dedupe")
	}
	fp, err := faults.Listen(u)
	if err != nil {
		t.Fatal(err)
	}
	defer fp.Close()
	brokerURL := "nats://" + fp.Addr()
	relayBroker := []string{"--nats", brokerURL}
	if r.amqp {
		relayBroker = []string{"--amqp", replaceHost(amqpURL, u, fp.Addr())}
		brokerURL = natsURL // the demo's --events (it runs no relay)
	}

	addr := closedPort(t)
	base := "http://" + addr
	demoOut, relayOut, workerOut := &tailBuffer{}, &tailBuffer{}, &tailBuffer{}
	env := []string{"IDEM_BROKEN_OUTBOX=" + broken}
	demoArgs := []string{"demo", "--addr", addr, "--metrics-addr", "", "--db", r.demoDB,
		"--events", brokerURL, "--events-subject", subject, "--events-lease", "2s", "--handler-delay", "30ms", "--lease", "2s"}
	if r.standaloneRelay {
		demoArgs = append(demoArgs, "--events-relay=false")
	}
	stopDemo, demoKills := chaos(t, 150*time.Millisecond, 900*time.Millisecond, func() *proc {
		return startProc(t, demoOut, env, idem, demoArgs...)
	})
	stopRelay := func() *proc { return nil }
	relayKills := new(atomic.Int64)
	if r.standaloneRelay {
		// Wait for the demo to create the outbox table.
		waitHTTP(t, base+"/healthz", 60*time.Second)
		stopRelay, relayKills = chaos(t, 150*time.Millisecond, 900*time.Millisecond, func() *proc {
			return startProc(t, relayOut, nil, idem, append([]string{"relay", "--db", r.demoDB, "--lease", "2s", "--poll", "50ms"}, relayBroker...)...)
		})
	}
	stopWorker, workerKills := func() *proc { return nil }, new(atomic.Int64)
	if !r.amqp {
		stopWorker, workerKills = chaos(t, 300*time.Millisecond, 1500*time.Millisecond, func() *proc {
			return startProc(t, workerOut, nil, worker, "-events", "-db", r.workerDB, "-nats", natsURL, "-subject", subject, "-ack-wait", "2s", "-lease", "2s")
		})
	}
	// The broker's connections: cut every few hundred milliseconds, and
	// black-holed (kept open, nothing forwarded) for up to 1.5 s now and then.
	var faultWG sync.WaitGroup
	faultDone := make(chan struct{})
	var cuts, holds atomic.Int64
	faultWG.Add(1)
	go func() {
		defer faultWG.Done()
		for {
			select {
			case <-faultDone:
				return
			case <-time.After(time.Duration(100+rand.IntN(400)) * time.Millisecond):
			}
			if rand.IntN(6) == 0 {
				fp.Hold()
				holds.Add(1)
				select {
				case <-faultDone:
				case <-time.After(time.Duration(200+rand.IntN(1300)) * time.Millisecond):
				}
				fp.Release()
			} else if fp.Cut() > 0 {
				cuts.Add(1)
			}
		}
	}()

	started := time.Now()
	answered, sent, retries, replays := pipelineClient(t, ctx, base, n, pipelineSpan(t))
	took := time.Since(started)
	close(faultDone)
	faultWG.Wait()
	fp.Release()
	demo := stopDemo()
	relay := stopRelay()
	t.Logf("%d orders answered in %v: %d requests, %d retries, %d replays; %d demo kills, %d relay kills, %d worker kills so far; %d connection cuts, %d black holes",
		len(answered), took.Round(time.Millisecond), sent, retries, replays, demoKills.Load(), relayKills.Load(), workerKills.Load(), cuts.Load(), holds.Load())
	if len(answered) != n {
		t.Fatalf("%d of %d orders were answered 201", len(answered), n)
	}

	// Drain: the outbox empties (the last relay publishes what the killed
	// ones leased, once their leases lapse, and what failed, after its
	// backoff).
	deadline := time.Now().Add(3 * time.Minute)
	for {
		code, out, errOut := runIdem(t, t.TempDir(), nil, "relay", "--db", r.demoDB, "--stats", "--json")
		var st struct {
			Pending     int64 `json:"pending"`
			DeadLetters int64 `json:"dead_letters"`
		}
		if code != 0 || json.Unmarshal([]byte(out), &st) != nil {
			t.Fatalf("idem relay --stats: exit %d %s %s", code, out, errOut)
		}
		if st.DeadLetters != 0 {
			t.Errorf("%d messages were dead-lettered", st.DeadLetters)
		}
		if st.Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d messages still pending 3 min after the last order; demo output:\n%s\nrelay output:\n%s", st.Pending, demoOut, relayOut)
		}
		time.Sleep(250 * time.Millisecond)
	}
	drained := time.Since(started)
	if r.amqp {
		demo.interrupt(t)
		relay.interrupt(t)
		// The consumer catches up: the queue empty, every order applied.
		deadline := time.Now().Add(2 * time.Minute)
		for quiet := 0; quiet < 4; {
			if queueDepth(t, amqpURL, subject) == 0 && len(aw.applied(t)) >= n {
				quiet++
			} else {
				quiet = 0
			}
			if time.Now().After(deadline) {
				t.Fatalf("the RabbitMQ consumer did not catch up in 2 min (%d in the queue, %d orders applied)", queueDepth(t, amqpURL, subject), len(aw.applied(t)))
			}
			time.Sleep(250 * time.Millisecond)
		}
		aw.stop()
		committed := r.committed(t)
		events := aw.deliveries()
		applied := aw.applied(t)
		ids := map[string]bool{}
		for _, e := range events {
			ids[e.msgID] = true
		}
		t.Logf("%d committed orders, %d deliveries to the consumer (%d message IDs: %d republications or redeliveries), %d effects applied; consumer connections cut %d times; outbox drained %v after the first order",
			len(committed), len(events), len(ids), len(events)-len(ids), sumApplied(applied), aw.cuts.Load(), drained.Round(time.Millisecond))
		if len(committed) != n {
			t.Errorf("%d orders committed for %d keys; want one per key", len(committed), n)
		}
		for _, f := range pipelineFindings(committed, events, applied) {
			t.Error(f)
		}
		return
	}
	// The worker catches up: nothing pending or unacked on its consumer.
	worker1 := stopWorker()
	cons, err := js.Consumer(ctx, stream, "orders-worker-events")
	if err != nil {
		t.Fatalf("the worker's consumer: %v; worker output:\n%s", err, workerOut)
	}
	deadline = time.Now().Add(2 * time.Minute)
	for quiet := 0; quiet < 4; {
		info, err := cons.Info(ctx)
		if err == nil && info.NumPending == 0 && info.NumAckPending == 0 {
			quiet++
		} else {
			quiet = 0
		}
		if time.Now().After(deadline) {
			t.Fatalf("the worker did not catch up in 2 min (%+v, %v); output:\n%s", info, err, workerOut)
		}
		time.Sleep(250 * time.Millisecond)
	}
	// A delivery the consumer naked (its claim still held by a killed
	// worker) comes back after a delay: wait until every committed order
	// was applied, or a minute, before counting.
	for deadline := time.Now().Add(time.Minute); len(r.applied(t)) < n && time.Now().Before(deadline); {
		time.Sleep(250 * time.Millisecond)
	}
	worker1.interrupt(t)
	demo.interrupt(t)
	if relay != nil {
		relay.interrupt(t)
	}

	committed := r.committed(t)
	events := readStream(t, js, stream)
	applied := r.applied(t)
	ids := map[string]bool{}
	for _, e := range events {
		ids[e.msgID] = true
	}
	t.Logf("%d committed orders, %d events on the stream (%d message IDs: %d republications stored), %d effects applied; outbox drained %v after the first order; %d worker kills in all",
		len(committed), len(events), len(ids), len(events)-len(ids), sumApplied(applied), drained.Round(time.Millisecond), workerKills.Load())
	if len(committed) != n {
		t.Errorf("%d orders committed for %d keys; want one per key", len(committed), n)
	}
	byID := map[string]bool{}
	for _, o := range committed {
		byID[o.id] = true
	}
	for i, id := range answered {
		if !byID[id] {
			t.Errorf("order %d was answered with %s, which is not in the table", i, id)
		}
	}
	for _, f := range pipelineFindings(committed, events, applied) {
		t.Error(f)
	}
	if t.Failed() && testing.Verbose() {
		t.Logf("demo output (tail):\n%s", lastLines(demoOut.String(), 40))
		t.Logf("worker output (tail):\n%s", lastLines(workerOut.String(), 40))
	}
}

func sumApplied(m map[string]int) int {
	n := 0
	for _, c := range m {
		n += c
	}
	return n
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

func netURLHost(raw string) (string, error) {
	h := strings.TrimPrefix(strings.TrimPrefix(raw, "nats://"), "tls://")
	if i := strings.IndexByte(h, '/'); i >= 0 {
		h = h[:i]
	}
	if _, _, err := net.SplitHostPort(h); err != nil {
		return "", err
	}
	return h, nil
}

// waitHTTP waits until url answers 200.
func waitHTTP(t *testing.T, url string, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not answer 200 within %v (%v)", url, within, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func pgCommitted(t *testing.T, url string) []committedOrder {
	t.Helper()
	conn := pgConnect(t, url)
	rows, err := conn.Query(context.Background(), "SELECT id, tenant, cart_id FROM orders")
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (committedOrder, error) {
		var o committedOrder
		err := r.Scan(&o.id, &o.tenant, &o.cart)
		return o, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func pgApplied(t *testing.T, url string) map[string]int {
	t.Helper()
	conn := pgConnect(t, url)
	rows, err := conn.Query(context.Background(), "SELECT order_id, count(*) FROM fulfilments GROUP BY order_id")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func sqliteApplied(t *testing.T, path string) map[string]int {
	t.Helper()
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	return sqlApplied(t, db)
}

func sqlApplied(t *testing.T, db *sql.DB) map[string]int {
	t.Helper()
	rows, err := db.Query("SELECT order_id, count(*) FROM fulfilments GROUP BY order_id")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

func sqliteCommitted(t *testing.T, path string) []committedOrder {
	t.Helper()
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	return sqlCommitted(t, db)
}

func sqlCommitted(t *testing.T, db *sql.DB) []committedOrder {
	t.Helper()
	rows, err := db.Query("SELECT id, tenant, cart_id FROM orders")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var out []committedOrder
	for rows.Next() {
		var o committedOrder
		if err := rows.Scan(&o.id, &o.tenant, &o.cart); err != nil {
			t.Fatal(err)
		}
		out = append(out, o)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// amqpHost is the host:port of an amqp:// URL.
func amqpHost(t *testing.T, raw string) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		t.Fatalf("AMQP URL %q: %v", raw, err)
	}
	if u.Port() == "" {
		return u.Host + ":5672"
	}
	return u.Host
}
