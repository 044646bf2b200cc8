package watermill_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	idemwm "github.com/idemkit/idem/consumer/watermill"
)

func TestMain(m *testing.M) {
	if prooftest.IsChild() {
		os.Exit(runChild())
	}
	os.Exit(m.Run())
}

// crashChild is a consumer process of the crash loop.
type crashChild struct {
	Target string
	Max    int
}

// stdoutPublisher is a poison "topic" the parent reads: one line per message.
type stdoutPublisher struct{}

func (stdoutPublisher) Publish(topic string, msgs ...*message.Message) error {
	for _, m := range msgs {
		fmt.Printf("DEAD %s %s %s\n", m.UUID, m.Metadata.Get(idemwm.MetaDeadReason), m.Metadata.Get(idemwm.MetaDeadAttempts))
	}
	return nil
}
func (stdoutPublisher) Close() error { return nil }

// runChild delivers the message "crash-1" to a handler that never returns:
// the parent kills the process with SIGKILL when it says RUN. The process
// restarts its delivery count at 1, as a restarted Watermill consumer does.
func runChild() int {
	var c crashChild
	if err := json.Unmarshal([]byte(os.Getenv(prooftest.ChildEnv)), &c); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx := context.Background()
	tg, _ := prooftest.Decode(c.Target)
	env, err := prooftest.Open(ctx, tg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	defer env.Close(false)
	p, err := consumer.New(env.Store, consumer.Config{Name: "crash", Lease: time.Second, MaxDeliveries: c.Max})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	h, err := idemwm.Handler(p, idemwm.Config{Poison: stdoutPublisher{}, PoisonTopic: "dead"}, func(msg *message.Message) ([]*message.Message, error) {
		if _, err := env.Insert(msg.Context(), &consumer.Message{ID: msg.UUID, Payload: msg.Payload}); err != nil {
			return nil, err
		}
		fmt.Println("RUN")
		select {} // the crash: the parent kills this process here
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	if _, err := h(message.NewMessage("crash-1", []byte("crashes every consumer"))); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	fmt.Println("SETTLED")
	return 0
}

// TestProofCrashLoop: a message whose handler crashes its consumer every time
// (SIGKILL mid-handler, the process restarted, its count back at 1) runs
// exactly MaxDeliveries times and is then dead-lettered unrun, with nothing
// committed, on PostgreSQL and SQLite.
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
			const maxD = 3
			b, _ := json.Marshal(crashChild{Target: tg.Encode(), Max: maxD})
			runs, dead := 0, ""
			for i := 0; i < 2*maxD+2 && dead == ""; i++ {
				cmd := exec.Command(os.Args[0], "-test.run=^$")
				cmd.Env = append(os.Environ(), prooftest.ChildEnv+"="+string(b))
				cmd.Stderr = os.Stderr
				out, err := cmd.StdoutPipe()
				if err != nil {
					t.Fatal(err)
				}
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				lines := bufio.NewScanner(out)
				for lines.Scan() {
					l := lines.Text()
					if l == "RUN" {
						runs++
						_ = cmd.Process.Signal(syscall.SIGKILL)
					}
					if strings.HasPrefix(l, "DEAD ") {
						dead = l
					}
				}
				_ = cmd.Wait()
			}
			rows, _, _ := env.Count(ctx)
			t.Logf("%s: %d runs, dead letter %q", kind, runs, dead)
			if runs != maxD || !strings.HasPrefix(dead, "DEAD crash-1 poison") || rows != 0 {
				t.Fatalf("%d runs, dead letter %q, %d rows; want MaxDeliveries (%d) runs, then the message dead-lettered unrun, and no row committed", runs, dead, rows, maxD)
			}
		})
	}
}

// TestProofStoreOutage: PostgreSQL behind a proxy that cuts and refuses every
// connection for a while (standing in for a ~30 s failover: the semantics do
// not depend on its length, only on it outlasting many Backoffs) while
// messages arrive: none is dead-lettered, none lost, each executed once.
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
	p, _ := consumer.New(env.Store, consumer.Config{Name: "outage", MaxDeliveries: 2, CleanupTimeout: time.Second,
		Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	ps := gochannel.NewGoChannel(gochannel.Config{OutputChannelBuffer: 100}, wm.NopLogger{})
	defer ps.Close()
	var dead atomic.Int32
	h, err := idemwm.Handler(p, idemwm.Config{Poison: countingPublisher{&dead}, PoisonTopic: "dead"}, func(msg *message.Message) ([]*message.Message, error) {
		_, err := env.Insert(msg.Context(), &consumer.Message{ID: msg.UUID, Payload: msg.Payload})
		return nil, err
	})
	if err != nil {
		t.Fatal(err)
	}
	out.SetDown(true)
	const n = 20
	done := make(chan error, n)
	for i := 0; i < n; i++ {
		go func() {
			_, err := h(message.NewMessage(fmt.Sprintf("o-%02d", i), []byte("order")))
			done <- err
		}()
	}
	time.Sleep(3 * time.Second) // thirty Backoffs
	out.SetDown(false)
	for i := 0; i < n; i++ {
		if err := <-done; err != nil {
			t.Fatal(err)
		}
	}
	rows, distinct, _ := direct.Count(ctx)
	st := p.Stats()
	t.Logf("stats %+v", st)
	if dead.Load() != 0 || rows != n || distinct != n || st.Executed != n || st.StoreFailed == 0 {
		t.Fatalf("%d dead-lettered, %d rows (%d distinct), stats %+v; want 0 dead, %d rows, each executed once after store failures", dead.Load(), rows, distinct, st, n)
	}
}

type countingPublisher struct{ n *atomic.Int32 }

func (c countingPublisher) Publish(string, ...*message.Message) error { c.n.Add(1); return nil }
func (c countingPublisher) Close() error                              { return nil }

// retryMiddleware does what Watermill's middleware.Retry does (calls h again
// on an error, up to max times), without its extra dependency.
func retryMiddleware(max int) message.HandlerMiddleware {
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) (out []*message.Message, err error) {
			for i := 0; i <= max; i++ {
				if out, err = h(msg); err == nil {
					return out, nil
				}
			}
			return nil, err
		}
	}
}

// Item 11: with Handler, idem is inside every router middleware: a Retry
// middleware around it cannot make two attempts share one idem transaction
// (a failed attempt's writes committing with the successful one's). The
// control shows what the other order, Retry inside idem, does.
func TestRetryMiddlewareStaysOutside(t *testing.T) {
	ctx := context.Background()
	for _, order := range []string{"handler", "control: retry inside"} {
		env, err := prooftest.Open(ctx, prooftest.NewTarget(t, "sqlite"))
		if err != nil {
			t.Fatal(err)
		}
		p, _ := consumer.New(env.Store, consumer.Config{Name: "retry", Backoff: func(int) time.Duration { return time.Millisecond }})
		calls := 0
		inner := func(msg *message.Message) ([]*message.Message, error) {
			calls++
			if _, err := env.Insert(msg.Context(), &consumer.Message{ID: msg.UUID, Payload: msg.Payload}); err != nil {
				return nil, err
			}
			if calls == 1 {
				return nil, fmt.Errorf("transient, after the insert")
			}
			return nil, nil
		}
		retry := retryMiddleware(3)
		cfg := idemwm.Config{Poison: countingPublisher{new(atomic.Int32)}, PoisonTopic: "dead"}
		var h message.HandlerFunc
		if order == "handler" {
			ih, err := idemwm.Handler(p, cfg, inner)
			if err != nil {
				t.Fatal(err)
			}
			h = retry(ih)
		} else {
			mw, _ := idemwm.Middleware(p, cfg)
			h = mw(retry(inner))
		}
		if _, err := h(message.NewMessage("r-1", []byte("order"))); err != nil {
			t.Fatal(err)
		}
		rows, _, _ := env.Count(ctx)
		env.Close(true)
		t.Logf("%s: %d rows", order, rows)
		if order == "handler" && rows != 1 {
			t.Fatalf("with Handler under a Retry middleware: %d rows; want 1 (each attempt its own transaction)", rows)
		}
	}
}

// Item 5: a COMMIT the database always refuses (a deferred constraint) is a
// failed attempt: the message is dead-lettered after MaxDeliveries runs, not
// retried as an outage forever.
func TestRefusedCommitIsPoison(t *testing.T) {
	for _, kind := range prooftest.Kinds {
		t.Run(kind, func(t *testing.T) {
			ctx := context.Background()
			env, err := prooftest.Open(ctx, prooftest.NewTarget(t, kind))
			if err != nil {
				t.Fatal(err)
			}
			defer env.Close(true)
			if err := env.CreateRefusedAtCommit(ctx); err != nil {
				t.Fatal(err)
			}
			p, _ := consumer.New(env.Store, consumer.Config{Name: "refused", MaxDeliveries: 3, Backoff: func(int) time.Duration { return time.Millisecond }})
			var dead atomic.Int32
			runs := 0
			h, _ := idemwm.Handler(p, idemwm.Config{Poison: countingPublisher{&dead}, PoisonTopic: "dead"}, func(msg *message.Message) ([]*message.Message, error) {
				runs++
				return nil, errorOf(env.InsertRefusedAtCommit(msg.Context(), &consumer.Message{ID: msg.UUID}))
			})
			mctx, cancel := context.WithTimeout(ctx, 20*time.Second)
			defer cancel()
			msg := message.NewMessage("refused-1", []byte("x"))
			msg.SetContext(mctx)
			if _, err := h(msg); err != nil {
				t.Fatalf("%v (stats %+v)", err, p.Stats())
			}
			if dead.Load() != 1 || runs != 3 {
				t.Fatalf("dead-lettered %d, ran %d times; want 1 and MaxDeliveries (3)", dead.Load(), runs)
			}
		})
	}
}

func errorOf(_ []byte, err error) error { return err }
