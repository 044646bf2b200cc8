package consumer_test

import (
	"context"
	"errors"
	"path/filepath"
	"sync"
	"testing"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// stepStores are the stores the step tests run on: memstore, and SQLite once
// sqlitestore keeps step records.
func stepStores(t *testing.T) map[string]idem.Store {
	m := memstore.New(nil)
	t.Cleanup(func() { _ = m.Close() })
	stores := map[string]idem.Store{"memstore": m}
	db, err := embedded.Open(filepath.Join(t.TempDir(), "steps.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	s, err := sqlitestore.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	if _, ok := any(s).(idem.StepStore); ok {
		stores["sqlite"] = s
	} else {
		t.Logf("sqlitestore keeps no step records yet (it is no idem.StepStore): the step tests run on memstore only")
	}
	return stores
}

// A message handler's step is recorded: the redelivery after a handler
// failure (here a panic after the step, before the record was stored) gets
// the recorded result without calling the service again, with the same
// derived key.
func TestStepInMessageHandler(t *testing.T) {
	for name, store := range stepStores(t) {
		t.Run(name, func(t *testing.T) {
			p, err := consumer.New(store, consumer.Config{Name: "steps-" + name, MaxDeliveries: 5})
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var keys []string
			calls := 0
			deliveries := 0
			h := func(ctx context.Context, msg *consumer.Message) ([]byte, error) {
				id, err := idem.Step(ctx, "charge", func(ctx context.Context, key string) (string, error) {
					mu.Lock()
					defer mu.Unlock()
					calls++
					keys = append(keys, key)
					return "ch_1", nil
				})
				if err != nil {
					return nil, err
				}
				k, _ := idem.StepKey(ctx, "charge")
				mu.Lock()
				keys = append(keys, k)
				deliveries++
				first := deliveries == 1
				mu.Unlock()
				if first {
					panic("crash after the charge")
				}
				return []byte(id), nil
			}
			msg := &consumer.Message{ID: "order-1", Payload: []byte(`{"total":1250}`)}
			if out := p.Process(context.Background(), msg, h); out.Action != consumer.Retry {
				t.Fatalf("first delivery: %+v", out)
			}
			out := p.Process(context.Background(), &consumer.Message{ID: "order-1", Payload: []byte(`{"total":1250}`), Delivery: 2}, h)
			if out.Action != consumer.Ack || string(out.Result) != "ch_1" {
				t.Fatalf("redelivery: %+v", out)
			}
			if calls != 1 || len(keys) != 3 || keys[0] != keys[1] || keys[1] != keys[2] {
				t.Fatalf("service calls %d, keys %v; want one call and one derived key throughout", calls, keys)
			}
		})
	}
}

// A step begun and never recorded (the handler died inside it) and refused
// (StepRefuse) dead-letters the message at once, without calling the service
// again; so does a step's final failure.
func TestStepUnknownAndFinalInMessageHandler(t *testing.T) {
	store := memstore.New(nil)
	t.Cleanup(func() { _ = store.Close() })
	p, err := consumer.New(store, consumer.Config{Name: "steps", MaxDeliveries: 5})
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	unknown := func(ctx context.Context, msg *consumer.Message) ([]byte, error) {
		_, err := idem.Step(ctx, "send", func(ctx context.Context, key string) (int, error) {
			calls++
			if calls == 1 {
				panic("died while the service was answering")
			}
			return 1, nil
		}, idem.OnUnknown(idem.StepRefuse))
		return nil, err
	}
	if out := p.Process(context.Background(), &consumer.Message{ID: "m1", Payload: []byte("x")}, unknown); out.Action != consumer.Retry {
		t.Fatalf("first delivery: %+v", out)
	}
	out := p.Process(context.Background(), &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 2}, unknown)
	if out.Action != consumer.DeadLetter || out.Reason != consumer.Poison || !errors.Is(out.Err, idem.ErrStepUnknown) || calls != 1 {
		t.Fatalf("redelivery of an unknown step: %+v, calls %d; want dead-lettered with ErrStepUnknown, the service not called again", out, calls)
	}

	declines := 0
	final := func(ctx context.Context, msg *consumer.Message) ([]byte, error) {
		_, err := idem.Step(ctx, "charge", func(ctx context.Context, key string) (int, error) {
			declines++
			return 0, idem.StepFinal(errors.New("card declined"))
		})
		return nil, err
	}
	out = p.Process(context.Background(), &consumer.Message{ID: "m2", Payload: []byte("x")}, final)
	if out.Action != consumer.DeadLetter || !errors.Is(out.Err, idem.ErrStepFailed) || declines != 1 {
		t.Fatalf("a final step failure: %+v, ran %d", out, declines)
	}
	out = p.Process(context.Background(), &consumer.Message{ID: "m2", Payload: []byte("x"), Delivery: 2}, final)
	if out.Action != consumer.DeadLetter || declines != 1 {
		t.Fatalf("a redelivery after a final step failure: %+v, ran %d; want dead-lettered, not a second run", out, declines)
	}
}
