package amqp_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	idemamqp "github.com/idemkit/idem/consumer/amqp"
	"github.com/idemkit/idem/consumer/internal/prooftest"
)

// runCrashChild consumes with amqp.Handle: "crash-*" messages print RUN and
// never return (the parent kills the process there), the others insert their
// row; a dead-lettered message prints DEAD.
func runCrashChild(c child) int {
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "child:", err); return 2 }
	ctx := context.Background()
	tg, _ := prooftest.Decode(c.Target)
	env, err := prooftest.Open(ctx, tg)
	if err != nil {
		return fail(err)
	}
	defer env.Close(false)
	p, err := consumer.New(env.Store, consumer.Config{Name: c.Consumer, Lease: time.Second, MaxDeliveries: c.Max, Backoff: func(int) time.Duration { return 50 * time.Millisecond }})
	if err != nil {
		return fail(err)
	}
	conn, err := amqp091.Dial(c.URL)
	if err != nil {
		return fail(err)
	}
	ch, _ := conn.Channel()
	if err := ch.Confirm(false); err != nil {
		return fail(err)
	}
	_ = ch.Qos(10, 0, false)
	ds, err := ch.Consume(c.Queue, "", false, false, false, false, nil)
	if err != nil {
		return fail(err)
	}
	cfg := &idemamqp.Config{Queue: c.Queue, Publisher: ch}
	for d := range ds {
		out, _ := idemamqp.Handle(ctx, p, &d, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
			if strings.HasPrefix(m.ID, "crash-") {
				fmt.Println("RUN", m.ID)
				select {}
			}
			return env.Insert(ctx, m)
		}, cfg)
		if out.Action == consumer.DeadLetter {
			fmt.Println("DEAD", d.MessageId, out.Reason)
		}
	}
	return 0
}

// TestProofCrashLoop: beside 50 good messages, a message whose handler
// crashes its consumer every time (SIGKILL mid-handler, a new process each
// time, RabbitMQ requeueing it when the connection drops) runs MaxDeliveries
// times and is then dead-lettered unrun; every good message is processed
// once, none lost.
func TestProofCrashLoop(t *testing.T) {
	for _, kind := range prooftest.Kinds {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			tg := prooftest.NewTarget(t, kind)
			env, err := prooftest.Open(ctx, tg)
			if err != nil {
				t.Fatal(err)
			}
			defer env.Close(true)
			b := newBroker(t)
			const maxD, goods = 3, 50
			b.publish(t, "", []string{"crash-1"}, payload)
			b.publish(t, "", ids(goods, "g"), payload)
			c := child{Target: tg.Encode(), URL: b.url, Queue: b.queue, Consumer: "crash", Crash: true, Max: maxD}
			runs, dead := 0, ""
			deadline := time.Now().Add(60 * time.Second)
			for dead == "" && time.Now().Before(deadline) {
				cmd, lines := startChild(t, c)
				for lines.Scan() {
					l := lines.Text()
					if strings.HasPrefix(l, "RUN ") {
						runs++
						_ = cmd.Process.Signal(syscall.SIGKILL)
					}
					if strings.HasPrefix(l, "DEAD ") {
						dead = l
						break
					}
				}
				if dead != "" {
					waitFor(t, 30*time.Second, "the good messages", func() bool { rows, _, _ := env.Count(ctx); return rows >= goods })
					_ = cmd.Process.Signal(syscall.SIGKILL)
				}
				_ = cmd.Wait()
			}
			rows, distinct, _ := env.Count(ctx)
			t.Logf("%s: crash-1 ran %d times; %q; %d rows", kind, runs, dead, rows)
			if runs != maxD || dead != "DEAD crash-1 poison" {
				t.Fatalf("crash-1 ran %d times, dead letter %q; want MaxDeliveries (%d) runs, then dead-lettered unrun as poison", runs, dead, maxD)
			}
			if rows != goods || distinct != goods {
				t.Fatalf("%d rows for %d IDs; want every good message once (%d)", rows, distinct, goods)
			}
			waitFor(t, 10*time.Second, "the dead letter in q.dead", func() bool { return b.depth(t, b.queue+".dead") == 1 })
		})
	}
}

// TestProofStoreOutage: PostgreSQL behind a proxy that cuts and refuses every
// connection for a while (standing in for a ~30 s failover: what matters is
// that it outlasts many Backoffs and MaxDeliveries of them) while messages
// arrive: none is dead-lettered, none lost, each executed once.
func TestProofStoreOutage(t *testing.T) {
	ctx := context.Background()
	tg := prooftest.NewTarget(t, "postgres")
	direct, err := prooftest.Open(ctx, tg)
	if err != nil {
		t.Fatal(err)
	}
	defer direct.Close(true)
	out := prooftest.NewOutage(t, prooftest.HostPort(t, tg.URL))
	ptg := tg
	ptg.URL = out.URL(t, tg.URL)
	env, err := prooftest.Open(ctx, ptg)
	if err != nil {
		t.Fatal(err)
	}
	defer env.Close(false)
	b := newBroker(t)
	p, _ := consumer.New(env.Store, consumer.Config{Name: "outage", MaxDeliveries: 2, CleanupTimeout: time.Second,
		Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	const n = 20
	var mu sync.Mutex
	acked := map[string]bool{}
	var dead atomic.Int32
	out.SetDown(true)
	stop := consume(t, b, p, env.Insert, "", func(d *amqp091.Delivery, o consumer.Outcome) {
		mu.Lock()
		defer mu.Unlock()
		switch o.Action {
		case consumer.Ack:
			acked[d.MessageId] = true
		case consumer.DeadLetter:
			dead.Add(1)
		}
	})
	b.publish(t, "", ids(n, "o"), payload)
	time.Sleep(3 * time.Second)
	out.SetDown(false)
	waitFor(t, 60*time.Second, "every message acked", func() bool { mu.Lock(); defer mu.Unlock(); return len(acked) == n })
	stop()
	rows, distinct, _ := direct.Count(ctx)
	st := p.Stats()
	t.Logf("stats %+v", st)
	if dead.Load() != 0 || rows != n || distinct != n || st.Executed != n || st.StoreFailed == 0 {
		t.Fatalf("%d dead-lettered, %d rows (%d distinct), stats %+v; want 0 dead, %d rows, each executed once after store failures", dead.Load(), rows, distinct, st, n)
	}
}
