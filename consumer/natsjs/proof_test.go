package natsjs_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	"github.com/idemkit/idem/consumer/natsjs"
)

// runCrashChild consumes with natsjs.Handle: "crash-*" messages print RUN and
// never return (the parent kills the process there), the others insert their
// row; a dead-lettered message prints DEAD.
func runCrashChild(c child) int {
	ctx := context.Background()
	tg, _ := prooftest.Decode(c.Target)
	env, err := prooftest.Open(ctx, tg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer env.Close(false)
	p, err := consumer.New(env.Store, consumer.Config{Name: c.Consumer, Lease: time.Second, MaxDeliveries: c.Max})
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
	cfg := &natsjs.Config{AckWait: time.Second}
	_, err = cons.Consume(func(msg jetstream.Msg) {
		out, _ := natsjs.Handle(ctx, p, msg, func(ctx context.Context, m *consumer.Message) ([]byte, error) {
			if strings.HasPrefix(m.ID, "crash-") {
				fmt.Println("RUN", m.ID)
				select {}
			}
			return env.Insert(ctx, m)
		}, cfg)
		if out.Action == consumer.DeadLetter {
			fmt.Println("DEAD", natsjs.Message(msg, "").ID, out.Reason)
		}
	}, jetstream.PullMaxMessages(10))
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	select {}
}

// TestProofCrashLoop: beside 50 good messages, a message whose handler
// crashes its consumer every time (SIGKILL mid-handler, a new process each
// time, JetStream redelivering after AckWait) runs MaxDeliveries times and is
// then dead-lettered unrun; every good message is processed once, none lost.
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
			b.consumer(t, "crash", time.Second)
			b.publish(t, jetstream.MsgIDHeader, []string{"crash-1"}, payload)
			b.publish(t, jetstream.MsgIDHeader, ids(goods, "g"), payload)
			c := child{Target: tg.Encode(), NATS: b.url, Stream: b.stream, Consumer: "crash", Crash: true, Max: maxD}
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
					// Let it finish the good messages, then kill it too.
					waitRows(t, env, goods, 30*time.Second)
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
		})
	}
}

func waitRows(t *testing.T, env *prooftest.Env, n int, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		rows, _, _ := env.Count(context.Background())
		if rows >= n || time.Now().After(deadline) {
			return
		}
		time.Sleep(50 * time.Millisecond)
	}
}
