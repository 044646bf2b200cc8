package watermill_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testenv"
	"github.com/idemkit/idem/outbox"
	outboxwm "github.com/idemkit/idem/outbox/watermill"
	"github.com/idemkit/idem/pgstore/pgoutbox"
)

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func newOutbox(t *testing.T) (*pgoutbox.Outbox, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, testenv.PostgresURL(t))
	if err != nil {
		t.Fatal(err)
	}
	schema := "idem_outbox_wm_" + randHex(5)
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+schema); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+schema+" CASCADE")
		pool.Close()
	})
	o, err := pgoutbox.New(pool, &pgoutbox.Config{Table: schema + ".outbox"})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return o, pool
}

// flaky fails every other publication, and refuses topic "refused" for good.
type flaky struct {
	message.Publisher
	mu sync.Mutex
	n  int
}

var errRefused = errors.New("refused by the broker")

func (f *flaky) Publish(topic string, msgs ...*message.Message) error {
	if topic == "refused" {
		return errRefused
	}
	f.mu.Lock()
	f.n++
	fail := f.n%2 == 1
	f.mu.Unlock()
	if fail {
		return errors.New("broker unavailable")
	}
	return f.Publisher.Publish(topic, msgs...)
}

// TestWatermill: messages reach a Watermill subscriber with UUID = ID and the
// headers as metadata, through transient failures; Config.Permanent
// dead-letters what it says is permanent.
func TestWatermill(t *testing.T) {
	o, pool := newOutbox(t)
	ctx := context.Background()
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true}, watermill.NopLogger{})
	defer ps.Close()
	sub, err := ps.Subscribe(ctx, "orders")
	if err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []outbox.Message{
		{ID: "a", Subject: "orders", Payload: []byte("A"), Headers: map[string]string{"X-Tenant": "t1"}},
		{ID: "b", Subject: "orders", Payload: []byte("B")},
		{ID: "c", Subject: "refused", Payload: []byte("C")},
	} {
		if err := o.Enqueue(ctx, tx, m); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	p := outboxwm.NewPublisher(&flaky{Publisher: ps}, &outboxwm.Config{Permanent: func(_ *outbox.Stored, err error) bool { return errors.Is(err, errRefused) }})
	r := &outbox.Relay{Source: o, Publisher: p, PollInterval: 10 * time.Millisecond, MinBackoff: 10 * time.Millisecond, MaxBackoff: 50 * time.Millisecond}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	go func() { _ = r.Run(rctx) }()
	got := map[string]*message.Message{}
	timeout := time.After(20 * time.Second)
	for len(got) < 2 {
		select {
		case m := <-sub:
			got[m.UUID] = m
			m.Ack()
		case <-timeout:
			t.Fatalf("received %d of 2", len(got))
		}
	}
	if string(got["a"].Payload) != "A" || got["a"].Metadata.Get("X-Tenant") != "t1" || string(got["b"].Payload) != "B" {
		t.Fatalf("received %v", got)
	}
	for {
		dead, err := o.DeadLetters(ctx, 10)
		if err != nil {
			t.Fatal(err)
		}
		if len(dead) == 1 {
			if dead[0].ID != "c" || !strings.Contains(dead[0].Reason, "refused by the broker") {
				t.Fatalf("dead letter %+v", dead[0])
			}
			break
		}
		select {
		case <-timeout:
			t.Fatal("c was not dead-lettered")
		case <-time.After(20 * time.Millisecond):
		}
	}
}
