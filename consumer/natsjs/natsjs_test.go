package natsjs_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	"github.com/idemkit/idem/consumer/natsjs"
	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/memstore"
)

func TestMain(m *testing.M) {
	if prooftest.IsChild() {
		os.Exit(runChild())
	}
	os.Exit(m.Run())
}

// child is what a re-executed test binary is told to do.
type child struct {
	Target   string
	NATS     string
	Stream   string
	Consumer string
	N        int           // exit once this many IDs were settled
	Sleep    time.Duration // per message, so that a kill lands mid-batch
	Crash    bool          // the crash-loop proof's consumer (runCrashChild)
	Max      int           // its MaxDeliveries
}

// runChild consumes with dedupe but never acknowledges: every message it sees
// is delivered again after AckWait. It prints "P <id>" per settled message.
func runChild() int {
	var c child
	if err := json.Unmarshal([]byte(os.Getenv(prooftest.ChildEnv)), &c); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if c.Crash {
		return runCrashChild(c)
	}
	ctx := context.Background()
	tg, _ := prooftest.Decode(c.Target)
	env, err := prooftest.Open(ctx, tg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer env.Close(false)
	p, err := consumer.New(env.Store, consumer.Config{Name: c.Consumer, Lease: 2 * time.Second})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	nc, err := nats.Connect(c.NATS)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	js, _ := jetstream.New(nc)
	cons, err := js.Consumer(ctx, c.Stream, c.Consumer)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	seen := map[string]bool{}
	var mu sync.Mutex
	done := make(chan struct{})
	out := bufio.NewWriter(os.Stdout)
	stopc, err := consumeG(cons, func(msg jetstream.Msg) {
		m := natsjs.Message(msg, "")
		o := p.Process(ctx, m, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
			time.Sleep(c.Sleep)
			return env.Insert(ctx, m)
		})
		if o.Action != consumer.Ack {
			_ = msg.NakWithDelay(o.Delay)
			return
		}
		// Withheld: no Ack.
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(out, "P %s\n", m.ID)
		_ = out.Flush()
		if !seen[m.ID] {
			seen[m.ID] = true
			if len(seen) == c.N {
				close(done)
			}
		}
	}, jetstream.PullMaxMessages(200))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		fmt.Fprintln(os.Stderr, "child: timed out")
		return 3
	}
	stopc()
	nc.Close() // unacknowledged: JetStream redelivers all after AckWait
	return 0
}

type broker struct {
	nc     *nats.Conn
	js     jetstream.JetStream
	url    string
	stream string
	subj   string
}

func newBroker(t *testing.T) *broker { return newBrokerB(t) }

func newBrokerB(t testing.TB) *broker {
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
	s := prooftest.Rand()
	b := &broker{nc: nc, js: js, url: url, stream: "IDEM_" + s, subj: "idem" + s}
	ctx := context.Background()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: b.stream, Subjects: []string{b.subj + ".>"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatalf("create stream (is JetStream enabled, nats-server -js?): %v", err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), b.stream) })
	return b
}

func (b *broker) consumer(t *testing.T, name string, ackWait time.Duration) jetstream.Consumer {
	t.Helper()
	c, err := b.js.CreateOrUpdateConsumer(context.Background(), b.stream, jetstream.ConsumerConfig{
		Durable: name, AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait, MaxDeliver: -1, MaxAckPending: 5000,
	})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func (b *broker) publishB(t testing.TB, all []string) {
	t.Helper()
	for _, id := range all {
		m := nats.NewMsg(b.subj + ".orders")
		m.Header.Set(jetstream.MsgIDHeader, id)
		m.Data = []byte(payload(id))
		if _, err := b.js.PublishMsgAsync(m); err != nil {
			t.Fatal(err)
		}
	}
	<-b.js.PublishAsyncComplete()
}

// publish sends the messages with their IDs in header (Nats-Msg-Id by default).
func (b *broker) publish(t *testing.T, header string, ids []string, payload func(string) string) {
	t.Helper()
	for _, id := range ids {
		m := nats.NewMsg(b.subj + ".orders")
		m.Header.Set(header, id)
		m.Data = []byte(payload(id))
		if _, err := b.js.PublishMsgAsync(m); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case <-b.js.PublishAsyncComplete():
	case <-time.After(30 * time.Second):
		t.Fatal("publishing timed out")
	}
}

// drained waits until the consumer has nothing pending and nothing unacknowledged.
func drained(t *testing.T, c jetstream.Consumer, timeout time.Duration, extra func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		info, err := c.Info(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if info.NumPending == 0 && info.NumAckPending == 0 && (extra == nil || extra()) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not drained after %v: %d pending, %d unacknowledged", timeout, info.NumPending, info.NumAckPending)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// consumeG consumes with h; the returned stop ends the consumption and waits
// for the callbacks running at that moment, after which none runs.
func consumeG(c jetstream.Consumer, h jetstream.MessageHandler, opts ...jetstream.PullConsumeOpt) (stop func(), err error) {
	var mu sync.RWMutex
	stopped := false
	cc, err := c.Consume(func(m jetstream.Msg) {
		mu.RLock()
		defer mu.RUnlock()
		if !stopped {
			h(m)
		}
	}, opts...)
	if err != nil {
		return nil, err
	}
	return func() {
		cc.Stop()
		mu.Lock()
		stopped = true
		mu.Unlock()
	}, nil
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

// TestExactlyOnce: 1,000 messages, each delivered at least twice — a consumer
// process killed with SIGKILL mid-batch, a second one that withholds every ack
// until AckWait, then an acknowledging one — leave exactly 1,000 rows.
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
			name := "worker"
			cons := b.consumer(t, name, 2*time.Second)
			all := ids(n, "m")
			b.publish(t, jetstream.MsgIDHeader, all, payload)

			// 1: a child that processes without acking, killed mid-batch.
			c := child{Target: tg.Encode(), NATS: b.url, Stream: b.stream, Consumer: name, N: n, Sleep: time.Millisecond}
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

			// 2: a child that settles all n without acking, then exits.
			c.Sleep = 0
			cmd, lines = startChild(t, c)
			second := map[string]bool{}
			for lines.Scan() {
				second[lines.Text()] = true
			}
			if err := cmd.Wait(); err != nil {
				t.Fatalf("second child: %v", err)
			}

			// 3: the acknowledging consumer.
			p, err := consumer.New(env.Store, consumer.Config{Name: name, Lease: 2 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			delivered := map[string]int{}
			stopc, err := consumeG(cons, func(msg jetstream.Msg) {
				out, err := natsjs.Handle(ctx, p, msg, env.Insert, nil)
				if err != nil {
					t.Errorf("settle: %v", err)
				}
				if out.Action == consumer.Ack {
					md, _ := msg.Metadata()
					mu.Lock()
					id := natsjs.Message(msg, "").ID // the most deliveries seen: JetStream may redeliver an acked message, counting afresh
					delivered[id] = max(delivered[id], int(md.NumDelivered))
					mu.Unlock()
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			drained(t, cons, 60*time.Second, func() bool { mu.Lock(); defer mu.Unlock(); return len(delivered) == n })
			stopc()

			rows, distinct, err := env.Count(ctx)
			if err != nil {
				t.Fatal(err)
			}
			mu.Lock() // a late redelivery's callback may still be running after Stop
			minD, acked := n, len(delivered)
			for _, d := range delivered {
				minD = min(minD, d)
			}
			mu.Unlock()
			st := p.Stats()
			t.Logf("%s: %d rows, %d distinct; last consumer: %+v; fewest deliveries of a message: %d", kind, rows, distinct, st, minD)
			if rows != n || distinct != n {
				t.Fatalf("%d rows for %d distinct IDs; want exactly %d of each", rows, distinct, n)
			}
			// Every message was delivered to the second child, which settled it
			// without acking, and again to the last consumer: at least twice each.
			// (JetStream's NumDelivered, logged above, is not the proof: the server
			// has been seen to report 1 on a redelivery of a message whose record was
			// already complete.)
			if len(second) != n || acked != n {
				t.Fatalf("the second child settled %d IDs and the last consumer acked %d; want %d each, so that every message is delivered at least twice", len(second), acked, n)
			}
			if st.Executed != 0 || st.Duplicate < n {
				t.Fatalf("the acknowledging consumer executed %d and acked %d as duplicates; want 0 and at least %d (the children processed all)", st.Executed, st.Duplicate, n)
			}
		})
	}
}

// TestControlWithoutDedupe: the same redelivery without the Processor creates
// duplicate rows, so TestExactlyOnce can fail.
func TestControlWithoutDedupe(t *testing.T) {
	const n = 100
	ctx := context.Background()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	b := newBroker(t)
	cons := b.consumer(t, "plain", time.Second)
	b.publish(t, jetstream.MsgIDHeader, ids(n, "c"), payload)
	var seen atomic.Int32
	stopc, err := consumeG(cons, func(msg jetstream.Msg) {
		if err := env.InsertPlain(ctx, natsjs.Message(msg, "")); err != nil {
			t.Error(err)
		}
		md, _ := msg.Metadata()
		if md.NumDelivered >= 2 { // the first delivery's ack is withheld
			_ = msg.Ack()
			seen.Add(1)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	drained(t, cons, 30*time.Second, func() bool { return seen.Load() >= n })
	stopc()
	rows, distinct, _ := env.Count(ctx)
	t.Logf("without dedupe: %d rows for %d IDs", rows, distinct)
	if rows <= n {
		t.Fatalf("the control run left %d rows for %d messages; redelivery should have duplicated them", rows, n)
	}
}

// TestThreeInstances: three consumers on one durable consumer at once, every ID
// published twice by the producer (under a header JetStream does not dedupe),
// a tenth of first deliveries left unacknowledged: one row per ID.
func TestThreeInstances(t *testing.T) {
	for _, kind := range prooftest.Kinds {
		t.Run(kind, func(t *testing.T) {
			t.Parallel()
			const n = 300
			ctx := context.Background()
			tg := prooftest.NewTarget(t, kind)
			b := newBroker(t)
			cons := b.consumer(t, "three", time.Second)
			all := ids(n, "o")
			b.publish(t, "Order-Id", append(append([]string{}, all...), all...), payload)
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
				nc, err := nats.Connect(b.url)
				if err != nil {
					t.Fatal(err)
				}
				defer nc.Close()
				js, _ := jetstream.New(nc)
				c, err := js.Consumer(ctx, b.stream, "three")
				if err != nil {
					t.Fatal(err)
				}
				cfg := &natsjs.Config{KeyHeader: "Order-Id"}
				stopc, err := consumeG(c, func(msg jetstream.Msg) {
					if md, _ := msg.Metadata(); md.NumDelivered == 1 && rand.IntN(10) == 0 {
						_, _ = p.Process(ctx, natsjs.Message(msg, "Order-Id"), func(ctx context.Context, m *consumer.Message) ([]byte, error) {
							time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
							return env.Insert(ctx, m)
						}), 0 // no ack: redelivered after AckWait
						return
					}
					out, err := natsjs.Handle(ctx, p, msg, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
						time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
						return env.Insert(ctx, m)
					}, cfg)
					if err != nil {
						t.Errorf("settle: %v", err)
					}
					if out.Action == consumer.Ack {
						acked.Add(1)
					}
				}, jetstream.PullMaxMessages(50))
				if err != nil {
					t.Fatal(err)
				}
				stops = append(stops, stopc)
			}
			drained(t, cons, 60*time.Second, func() bool { return acked.Load() >= 2*n })
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

// TestPoison: a message whose handler always fails is retried with backoff,
// dead-lettered (copied to the dead-letter subject, terminated) after
// MaxDeliveries, and the messages behind it keep flowing meanwhile.
func TestPoison(t *testing.T) {
	ctx := context.Background()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	b := newBroker(t)
	dlStream := b.stream + "_DEAD"
	if _, err := b.js.CreateStream(ctx, jetstream.StreamConfig{Name: dlStream, Subjects: []string{b.subj + "dead"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	defer b.js.DeleteStream(context.Background(), dlStream)
	cons := b.consumer(t, "poison", 5*time.Second)
	p, err := consumer.New(env.Store, consumer.Config{Name: "poison", MaxDeliveries: 3, Backoff: func(int) time.Duration { return 300 * time.Millisecond }})
	if err != nil {
		t.Fatal(err)
	}
	var poisonRuns, goodsWhilePoisoned atomic.Int32
	var poisoned atomic.Bool
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		if m.ID == "poison" {
			poisonRuns.Add(1)
			poisoned.Store(true)
			return nil, errors.New("cannot parse the order")
		}
		if poisoned.Load() {
			goodsWhilePoisoned.Add(1)
		}
		return env.Insert(ctx, m)
	}
	var dead atomic.Int32
	cfg := &natsjs.Config{JetStream: b.js, DeadLetterSubject: b.subj + "dead"}
	stopc, err := consumeG(cons, func(msg jetstream.Msg) {
		out, err := natsjs.Handle(ctx, p, msg, h, cfg)
		if err != nil {
			t.Errorf("settle: %v", err)
		}
		if out.Action == consumer.DeadLetter {
			poisoned.Store(false)
			dead.Add(1)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(t, jetstream.MsgIDHeader, []string{"poison"}, payload)
	time.Sleep(50 * time.Millisecond)
	goods := ids(50, "g")
	for i := 0; i < len(goods); i += 10 {
		b.publish(t, jetstream.MsgIDHeader, goods[i:i+10], payload)
		time.Sleep(20 * time.Millisecond)
	}
	drained(t, cons, 30*time.Second, func() bool { return dead.Load() == 1 })
	stopc()
	rows, _, _ := env.Count(ctx)
	if rows != 50 || poisonRuns.Load() != 3 || p.Stats().Poison != 1 {
		t.Fatalf("%d rows (want 50), the poison ran %d times (want 3), %d poison outcomes (want 1)", rows, poisonRuns.Load(), p.Stats().Poison)
	}
	if goodsWhilePoisoned.Load() == 0 {
		t.Fatal("no message was processed while the poison message was being retried: the stream did not keep flowing")
	}
	ds, err := b.js.Stream(ctx, dlStream)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := ds.GetLastMsgForSubject(ctx, b.subj+"dead")
	if err != nil {
		t.Fatalf("the poison message is not on the dead-letter subject: %v", err)
	}
	if raw.Header.Get(natsjs.HeaderDeadReason) != "poison" || raw.Header.Get(natsjs.HeaderDeadDeliveries) != "3" || string(raw.Data) != payload("poison") {
		t.Fatalf("dead-lettered copy: headers %v, data %q", raw.Header, raw.Data)
	}
	t.Logf("%d goods processed while the poison message was retried; dead-letter error: %s", goodsWhilePoisoned.Load(), raw.Header.Get(natsjs.HeaderDeadError))
}

// TestMismatch: one ID published again with another payload is not executed,
// and is dead-lettered and counted.
func TestMismatch(t *testing.T) {
	ctx := context.Background()
	env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(true)
	b := newBroker(t)
	cons := b.consumer(t, "mm", 5*time.Second)
	p, _ := consumer.New(env.Store, consumer.Config{Name: "mm"})
	var settled atomic.Int32
	stopc, err := consumeG(cons, func(msg jetstream.Msg) {
		_, _ = natsjs.Handle(ctx, p, msg, env.Insert, &natsjs.Config{KeyHeader: "Order-Id"})
		settled.Add(1)
	})
	if err != nil {
		t.Fatal(err)
	}
	b.publish(t, "Order-Id", []string{"x1"}, payload)
	b.publish(t, "Order-Id", []string{"x1"}, func(string) string { return "other" })
	drained(t, cons, 10*time.Second, func() bool { return settled.Load() == 2 })
	stopc()
	rows, _, _ := env.Count(ctx)
	if st := p.Stats(); rows != 1 || st.Mismatch != 1 || st.Executed != 1 {
		t.Fatalf("%d rows, stats %+v; want 1 row, 1 executed, 1 mismatch", rows, st)
	}
}

// TestDeadLetterOfALargeMessage: a poison message whose payload fills the
// server's max_payload. Its dead-letter copy carries the payload plus the
// Idem-Dead-* headers, so it does not fit in one NATS message; the message
// must still leave the stream (Term) with a copy on the dead-letter subject,
// not be naked and redelivered forever, running its handler each time.
func TestDeadLetterOfALargeMessage(t *testing.T) {
	ctx := context.Background()
	b := newBroker(t)
	dlStream := b.stream + "_DEAD"
	if _, err := b.js.CreateStream(ctx, jetstream.StreamConfig{Name: dlStream, Subjects: []string{b.subj + "dead"}, Storage: jetstream.MemoryStorage}); err != nil {
		t.Fatal(err)
	}
	defer b.js.DeleteStream(context.Background(), dlStream)
	cons := b.consumer(t, "large", 30*time.Second)
	p, err := consumer.New(memstore.New(nil), consumer.Config{Name: "large"})
	if err != nil {
		t.Fatal(err)
	}
	m := nats.NewMsg(b.subj + ".orders")
	m.Header.Set(jetstream.MsgIDHeader, "big-1")
	// The published message's headers take ~40 bytes; leave 200 to spare.
	m.Data = bytes.Repeat([]byte("x"), int(b.nc.MaxPayload())-200)
	if _, err := b.js.PublishMsg(ctx, m); err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		runs++
		return nil, consumer.Permanent(errors.New("cannot parse the order: " + strings.Repeat("detail ", 50)))
	}
	cfg := &natsjs.Config{JetStream: b.js, DeadLetterSubject: b.subj + "dead"}
	batch, err := cons.Fetch(1, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := 0
	for msg := range batch.Messages() {
		got++
		out, err := natsjs.Handle(ctx, p, msg, h, cfg)
		if err != nil || out.Action != consumer.DeadLetter {
			t.Fatalf("Handle = %v, %v; want the message dead-lettered and terminated", out.Action, err)
		}
	}
	if got != 1 || runs != 1 {
		t.Fatalf("fetched %d messages, handler ran %d times; want 1 and 1", got, runs)
	}
	ds, err := b.js.Stream(ctx, dlStream)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := ds.GetLastMsgForSubject(ctx, b.subj+"dead")
	if err != nil {
		t.Fatalf("nothing on the dead-letter subject: %v", err)
	}
	if raw.Header.Get(natsjs.HeaderDeadReason) != "poison" {
		t.Fatalf("dead-lettered copy: headers %v", raw.Header)
	}
	if !bytes.Equal(raw.Data, m.Data) && raw.Header.Get(natsjs.HeaderDeadTruncated) == "" {
		t.Fatalf("dead-lettered copy has %d of %d payload bytes and does not say it is truncated (headers %v)", len(raw.Data), len(m.Data), raw.Header)
	}
	if tr := raw.Header.Get(natsjs.HeaderDeadTruncated); tr != "" && (!strings.Contains(tr, fmt.Sprint(len(m.Data))) || !strings.Contains(tr, b.stream)) {
		t.Fatalf("%s: %q; want the left-out size %d and the stream %s", natsjs.HeaderDeadTruncated, tr, len(m.Data), b.stream)
	}
	drained(t, cons, 10*time.Second, nil)
}
