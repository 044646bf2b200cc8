package amqp_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	idemamqp "github.com/idemkit/idem/consumer/amqp"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/memstore"
)

func TestMain(m *testing.M) {
	if prooftest.IsChild() {
		os.Exit(runChild())
	}
	os.Exit(m.Run())
}

type child struct {
	Target   string
	URL      string
	Queue    string
	Consumer string
	N        int
	Sleep    time.Duration
	Crash    bool // the crash-loop proof's consumer (runCrashChild)
	Max      int  // its MaxDeliveries
}

// runChild consumes with dedupe and never acknowledges; it exits (closing the
// connection, so RabbitMQ requeues everything) once N IDs were settled, and
// prints "P <id>" per settled delivery.
func runChild() int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "child:", err); return 2 }
	var c child
	if err := json.Unmarshal([]byte(os.Getenv(prooftest.ChildEnv)), &c); err != nil {
		return fail(err)
	}
	if c.Crash {
		return runCrashChild(c)
	}
	ctx := context.Background()
	tg, _ := prooftest.Decode(c.Target)
	env, err := prooftest.Open(ctx, tg)
	if err != nil {
		return fail(err)
	}
	defer env.Close(false)
	p, err := consumer.New(env.Store, consumer.Config{Name: c.Consumer, Lease: 2 * time.Second})
	if err != nil {
		return fail(err)
	}
	conn, err := amqp091.Dial(c.URL)
	if err != nil {
		return fail(err)
	}
	defer conn.Close()
	ch, _ := conn.Channel()
	_ = ch.Qos(5000, 0, false)
	ds, err := ch.ConsumeWithContext(ctx, c.Queue, "", false, false, false, false, nil)
	if err != nil {
		return fail(err)
	}
	out := bufio.NewWriter(os.Stdout)
	seen := map[string]bool{}
	timeout := time.After(60 * time.Second)
	for len(seen) < c.N {
		select {
		case d := <-ds:
			m := idemamqp.Message(&d, "")
			o := p.Process(ctx, m, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
				time.Sleep(c.Sleep)
				return env.Insert(ctx, m)
			})
			if o.Action != consumer.Ack {
				// Wait as the adapter's delayed retry would (a message in flight in
				// the killed consumer waits out its lease): an immediate requeue
				// spins through MaxDeliveries (a quorum queue counts every requeue)
				// and the message ends dead-lettered instead of processed.
				if o.Action == consumer.Retry {
					time.Sleep(min(o.Delay, 3*time.Second))
				}
				_ = d.Nack(false, true)
				continue
			}
			fmt.Fprintf(out, "P %s\n", m.ID)
			_ = out.Flush()
			seen[m.ID] = true
		case <-timeout:
			return fail(errors.New("timed out"))
		}
	}
	return 0 // unacknowledged: the closing connection requeues all
}

type broker struct {
	url   string
	conn  *amqp091.Connection
	ch    *amqp091.Channel
	queue string
}

func newBroker(t *testing.T) *broker {
	t.Helper()
	url := testenv.AMQPURL(t)
	conn, err := amqp091.Dial(url)
	if err != nil {
		t.Fatalf("connect to RabbitMQ at %s: %v", url, err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	b := &broker{url: url, conn: conn, ch: ch, queue: "idem-test-" + prooftest.Rand()}
	if err := idemamqp.Declare(ch, b.queue); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, q := range append([]string{b.queue, b.queue + ".retry", b.queue + ".dead"}, idemamqp.RetryQueues(b.queue)...) {
			_, _ = ch.QueueDelete(q, false, false, false)
		}
	})
	return b
}

func (b *broker) publish(t *testing.T, header string, ids []string, payload func(string) string) {
	t.Helper()
	ctx := context.Background()
	var confs []*amqp091.DeferredConfirmation
	for _, id := range ids {
		pub := amqp091.Publishing{Body: []byte(payload(id)), DeliveryMode: amqp091.Persistent}
		if header == "" {
			pub.MessageId = id
		} else {
			pub.Headers = amqp091.Table{header: id}
		}
		c, err := b.ch.PublishWithDeferredConfirmWithContext(ctx, "", b.queue, false, false, pub)
		if err != nil {
			t.Fatal(err)
		}
		confs = append(confs, c)
	}
	for _, c := range confs {
		if !c.Wait() {
			t.Fatal("RabbitMQ did not confirm a published message")
		}
	}
}

func (b *broker) depth(t *testing.T, q string) int {
	t.Helper()
	ch, err := b.conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	info, err := ch.QueueDeclarePassive(q, true, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return info.Messages
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func ids(n int, prefix string) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%04d", prefix, i)
	}
	return out
}

func payload(id string) string { return `{"order":"` + id + `"}` }

func startChild(t *testing.T, c child) (*exec.Cmd, *bufio.Scanner) {
	t.Helper()
	b, _ := json.Marshal(c)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), prooftest.ChildEnv+"="+string(b))
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, bufio.NewScanner(stdout)
}

// consume runs one consumer on its own channel with Handle until stop is called.
func consume(t *testing.T, b *broker, p *consumer.Processor, h consumer.Handler, keyHeader string, settled func(*amqp091.Delivery, consumer.Outcome)) (stop func()) {
	t.Helper()
	conn, err := amqp091.Dial(b.url)
	if err != nil {
		t.Fatal(err)
	}
	ch, _ := conn.Channel()
	if err := ch.Confirm(false); err != nil {
		t.Fatal(err)
	}
	_ = ch.Qos(50, 0, false)
	ds, err := ch.Consume(b.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &idemamqp.Config{Queue: b.queue, Publisher: ch, KeyHeader: keyHeader}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for d := range ds {
			out, err := idemamqp.Handle(context.Background(), p, &d, h, cfg)
			if err != nil {
				t.Errorf("settle: %v", err)
			}
			if settled != nil {
				settled(&d, out)
			}
		}
	}()
	return func() { _ = conn.Close(); <-done }
}

// TestExactlyOnce: 1,000 messages, each delivered at least twice — a consumer
// process killed with SIGKILL mid-batch, a second one that withholds every ack
// until its channel closes, then an acknowledging one — leave exactly 1,000 rows.
func TestExactlyOnce(t *testing.T) {
	for _, kind := range prooftest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			const n = 1000
			ctx := context.Background()
			tg := prooftest.NewTarget(t, kind)
			env, err := prooftest.Open(ctx, tg)
			if err != nil {
				t.Fatal(err)
			}
			defer env.Close(true)
			b := newBroker(t)
			b.publish(t, "", ids(n, "m"), payload)
			name := "worker"

			c := child{Target: tg.Encode(), URL: b.url, Queue: b.queue, Consumer: name, N: n, Sleep: time.Millisecond}
			cmd, lines := startChild(t, c)
			for i := 0; i < n/3 && lines.Scan(); i++ {
			}
			if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			err = cmd.Wait()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
				t.Fatalf("first child was not killed mid-batch: %v", err)
			}
			rows, _, _ := env.Count(ctx)
			t.Logf("killed the first consumer after %d committed rows", rows)
			if rows == 0 || rows >= n {
				t.Fatalf("the kill did not land mid-batch: %d rows", rows)
			}

			c.Sleep = 0
			cmd, lines = startChild(t, c)
			for lines.Scan() {
			}
			if err := cmd.Wait(); err != nil {
				t.Fatalf("second child: %v", err)
			}

			p, err := consumer.New(env.Store, consumer.Config{Name: name, Lease: 2 * time.Second, Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			delivered := map[string]int{}
			stop := consume(t, b, p, env.Insert, "", func(d *amqp091.Delivery, out consumer.Outcome) {
				if out.Action == consumer.Ack {
					mu.Lock()
					delivered[d.MessageId] = max(delivered[d.MessageId], brokerDeliveries(d))
					mu.Unlock()
				}
			})
			waitFor(t, 60*time.Second, "every message acknowledged", func() bool { mu.Lock(); defer mu.Unlock(); return len(delivered) == n })
			stop()
			if d := b.depth(t, b.queue) + b.depth(t, b.queue+".retry") + b.depth(t, b.queue+".dead"); d != 0 {
				t.Fatalf("%d messages left in the queues", d)
			}
			rows, distinct, err := env.Count(ctx)
			if err != nil {
				t.Fatal(err)
			}
			minD := n
			for _, d := range delivered {
				minD = min(minD, d)
			}
			st := p.Stats()
			t.Logf("%s: %d rows, %d distinct; last consumer: %+v; fewest deliveries of a message: %d", kind, rows, distinct, st, minD)
			if rows != n || distinct != n {
				t.Fatalf("%d rows for %d distinct IDs; want exactly %d of each", rows, distinct, n)
			}
			if minD < 2 {
				t.Fatalf("a message was delivered only %d time(s); the proof needs every one at least twice", minD)
			}
			if st.Executed != 0 {
				t.Fatalf("the acknowledging consumer executed %d messages; the children had processed all", st.Executed)
			}
		})
	}
}

// TestControlWithoutDedupe: the same redelivery without the Processor
// duplicates rows, so TestExactlyOnce can fail.
func TestControlWithoutDedupe(t *testing.T) {
	const n = 100
	ctx := context.Background()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	b := newBroker(t)
	b.publish(t, "", ids(n, "c"), payload)
	conn, _ := amqp091.Dial(b.url)
	defer conn.Close()
	ch, _ := conn.Channel()
	_ = ch.Qos(1000, 0, false)
	ds, err := ch.Consume(b.queue, "", false, false, false, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	acked := 0
	for acked < n {
		select {
		case d := <-ds:
			if err := env.InsertPlain(ctx, idemamqp.Message(&d, "")); err != nil {
				t.Fatal(err)
			}
			if d.Redelivered {
				_ = d.Ack(false)
				acked++
			} else {
				_ = d.Nack(false, true) // as a consumer whose ack was lost
			}
		case <-time.After(20 * time.Second):
			t.Fatal("timed out")
		}
	}
	rows, distinct, _ := env.Count(ctx)
	t.Logf("without dedupe: %d rows for %d IDs", rows, distinct)
	if rows <= n {
		t.Fatalf("the control run left %d rows for %d messages; redelivery should have duplicated them", rows, n)
	}
}

// TestThreeInstances: three consumers on one queue at once, every message ID
// published twice by the producer: one row per ID.
func TestThreeInstances(t *testing.T) {
	for _, kind := range prooftest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			const n = 300
			ctx := context.Background()
			tg := prooftest.NewTarget(t, kind)
			b := newBroker(t)
			all := ids(n, "o")
			var acked atomic.Int32
			var procs []*consumer.Processor
			var stops []func()
			for i := 0; i < 3; i++ {
				env, err := prooftest.Open(ctx, tg)
				if err != nil {
					t.Fatal(err)
				}
				defer env.Close(i == 0)
				p, err := consumer.New(env.Store, consumer.Config{Name: "three", Lease: time.Second, Backoff: func(int) time.Duration { return 50 * time.Millisecond }})
				if err != nil {
					t.Fatal(err)
				}
				procs = append(procs, p)
				stops = append(stops, consume(t, b, p, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
					time.Sleep(time.Millisecond)
					return env.Insert(ctx, m)
				}, "", func(_ *amqp091.Delivery, out consumer.Outcome) {
					if out.Action == consumer.Ack {
						acked.Add(1)
					}
				}))
			}
			b.publish(t, "", append(append([]string{}, all...), all...), payload)
			waitFor(t, 60*time.Second, "every delivery acknowledged", func() bool { return acked.Load() >= 2*n })
			for _, s := range stops {
				s()
			}
			env, err := prooftest.Open(ctx, tg)
			if err != nil {
				t.Fatal(err)
			}
			defer env.Close(false)
			rows, distinct, _ := env.Count(ctx)
			var ex, dup, inflight int64
			for _, p := range procs {
				st := p.Stats()
				ex, dup, inflight = ex+st.Executed, dup+st.Duplicate, inflight+st.InFlight
			}
			t.Logf("%s: %d rows, %d distinct; executed %d, duplicates %d, in flight %d", kind, rows, distinct, ex, dup, inflight)
			if rows != n || distinct != n {
				t.Fatalf("%d rows for %d distinct IDs; want exactly %d", rows, distinct, n)
			}
		})
	}
}

// TestPoison: a message whose handler always fails is retried through the
// retry queue, then dead-lettered to q.dead after MaxDeliveries, while the
// messages behind it keep flowing.
func TestPoison(t *testing.T) {
	ctx := context.Background()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	b := newBroker(t)
	p, err := consumer.New(env.Store, consumer.Config{Name: "poison", MaxDeliveries: 3, Backoff: func(int) time.Duration { return 300 * time.Millisecond }})
	if err != nil {
		t.Fatal(err)
	}
	var poisonRuns, goodsWhilePoisoned, dead, good atomic.Int32
	var poisoned atomic.Bool
	stop := consume(t, b, p, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		if m.ID == "poison" {
			poisonRuns.Add(1)
			poisoned.Store(true)
			return nil, errors.New("cannot parse the order")
		}
		if poisoned.Load() {
			goodsWhilePoisoned.Add(1)
		}
		return env.Insert(ctx, m)
	}, "", func(_ *amqp091.Delivery, out consumer.Outcome) {
		switch {
		case out.Action == consumer.DeadLetter:
			poisoned.Store(false)
			dead.Add(1)
		case out.Reason == consumer.Executed:
			good.Add(1)
		}
	})
	b.publish(t, "", []string{"poison"}, payload)
	time.Sleep(50 * time.Millisecond)
	goods := ids(50, "g")
	for i := 0; i < len(goods); i += 10 {
		b.publish(t, "", goods[i:i+10], payload)
		time.Sleep(20 * time.Millisecond)
	}
	waitFor(t, 30*time.Second, "the poison message dead-lettered and the goods processed", func() bool { return dead.Load() == 1 && good.Load() == 50 })
	stop()
	rows, _, _ := env.Count(ctx)
	if rows != 50 || poisonRuns.Load() != 3 || p.Stats().Poison != 1 {
		t.Fatalf("%d rows (want 50), the poison ran %d times (want 3), %d poison outcomes (want 1)", rows, poisonRuns.Load(), p.Stats().Poison)
	}
	if goodsWhilePoisoned.Load() == 0 {
		t.Fatal("no message was processed while the poison message was being retried")
	}
	waitFor(t, 5*time.Second, "the poison message in the dead-letter queue", func() bool { return b.depth(t, b.queue+".dead") == 1 })
	conn, _ := amqp091.Dial(b.url)
	defer conn.Close()
	ch, _ := conn.Channel()
	d, ok, err := ch.Get(b.queue+".dead", true)
	if err != nil || !ok || d.MessageId != "poison" || string(d.Body) != payload("poison") {
		t.Fatalf("dead letter: %v %v %+v", ok, err, d)
	}
	t.Logf("%d goods processed while the poison message was retried; x-death: %v", goodsWhilePoisoned.Load(), d.Headers["x-death"])
}

// TestHostileRetriesHeader: a producer (or anything upstream) that sets the
// adapter's own x-idem-retries header to a negative or huge number must not
// buy a failing message more runs than MaxDeliveries, nor wrap the count
// around: each such poison message runs at most MaxDeliveries times and is
// dead-lettered.
func TestHostileRetriesHeader(t *testing.T) {
	ctx := context.Background()
	b := newBroker(t)
	const maxDeliveries = 3
	p, err := consumer.New(memstore.New(nil), consumer.Config{Name: "hostile", MaxDeliveries: maxDeliveries, Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
	if err != nil {
		t.Fatal(err)
	}
	values := map[string]any{"neg32": int32(-1 << 31), "neg64": int64(-1 << 62), "max64": int64(1<<63 - 1), "negstr": "-999999999"}
	var mu sync.Mutex
	runs := map[string]int{}
	var dead atomic.Int32
	stop := consume(t, b, p, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		mu.Lock()
		runs[m.ID]++
		n := runs[m.ID]
		mu.Unlock()
		if n > maxDeliveries {
			return nil, consumer.Permanent(fmt.Errorf("ran %d times", n)) // end the loop; the count fails the test
		}
		return nil, errors.New("cannot parse the order")
	}, "", func(_ *amqp091.Delivery, out consumer.Outcome) {
		if out.Action == consumer.DeadLetter {
			dead.Add(1)
		}
	})
	defer stop()
	for id, v := range values {
		c, err := b.ch.PublishWithDeferredConfirmWithContext(ctx, "", b.queue, false, false, amqp091.Publishing{
			MessageId: id, Body: []byte(payload(id)), Headers: amqp091.Table{idemamqp.RetriesHeader: v},
		})
		if err != nil || !c.Wait() {
			t.Fatalf("publish %s: %v", id, err)
		}
	}
	waitFor(t, 30*time.Second, "every hostile message dead-lettered", func() bool { return dead.Load() == int32(len(values)) })
	mu.Lock()
	defer mu.Unlock()
	for id := range values {
		if runs[id] > maxDeliveries {
			t.Errorf("%s (x-idem-retries %v): the handler ran %d times; want at most MaxDeliveries (%d)", id, values[id], runs[id], maxDeliveries)
		}
	}
}

// failingClaims is a store whose first Claims fail, as during an outage.
type failingClaims struct {
	idem.Store
	left atomic.Int32
}

func (s *failingClaims) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if s.left.Add(-1) >= 0 {
		return nil, false, errors.New("store: connection refused")
	}
	return s.Store.Claim(ctx, req)
}

// TestStoreOutageIsNotPoison: a store that fails more times in a row than
// MaxDeliveries delays a message, but does not dead-letter it unrun: store
// failures are not failed deliveries. The message then runs once, and a
// handler failure after the outage still gets its MaxDeliveries.
func TestStoreOutageIsNotPoison(t *testing.T) {
	b := newBroker(t)
	store := &failingClaims{Store: memstore.New(nil)}
	store.left.Store(6)
	const maxDeliveries = 2
	p, err := consumer.New(store, consumer.Config{Name: "outage", MaxDeliveries: maxDeliveries, Backoff: func(int) time.Duration { return 10 * time.Millisecond }})
	if err != nil {
		t.Fatal(err)
	}
	var runs, dead, executed, outages atomic.Int32
	var failOnce atomic.Bool
	failOnce.Store(true)
	stop := consume(t, b, p, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		runs.Add(1)
		if failOnce.CompareAndSwap(true, false) {
			return nil, errors.New("a transient failure after the outage")
		}
		return []byte("done"), nil
	}, "", func(_ *amqp091.Delivery, out consumer.Outcome) {
		switch {
		case out.Action == consumer.DeadLetter:
			dead.Add(1)
		case out.Reason == consumer.Executed:
			executed.Add(1)
		case out.Reason == consumer.StoreFailed:
			outages.Add(1)
		}
	})
	defer stop()
	b.publish(t, "", []string{"during-outage"}, payload)
	waitFor(t, 30*time.Second, "the message settled", func() bool { return dead.Load()+executed.Load() > 0 })
	if dead.Load() != 0 || executed.Load() != 1 || runs.Load() != 2 || outages.Load() != 6 {
		t.Fatalf("dead-lettered %d, executed %d, handler runs %d, store failures %d; want 0, 1, 2 (one failure, one success) and 6",
			dead.Load(), executed.Load(), runs.Load(), outages.Load())
	}
}

// brokerDeliveries is the count of a delivery as RabbitMQ and the retry
// copies carry it: 1 + x-idem-retries (a copy carries the deliveries before it
// there) + the quorum queue's x-delivery-count, at least 2 when flagged
// Redelivered.
func brokerDeliveries(d *amqp091.Delivery) int {
	n := 1
	for _, h := range []string{idemamqp.RetriesHeader, "x-delivery-count"} {
		switch v := d.Headers[h].(type) {
		case int64:
			n += int(v)
		case int32:
			n += int(v)
		case int:
			n += v
		}
	}
	if d.Redelivered && n < 2 {
		n = 2
	}
	return n
}
