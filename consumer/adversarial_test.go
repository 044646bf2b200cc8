package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/sqlitestore"
)

// A Config.Scope hook that panics on a message does not take the consumer
// down with it (every redelivery would crash the next process, forever): the
// message is dead-lettered unrun, saying why, and the next one is processed.
func TestScopeHookPanics(t *testing.T) {
	p, _, db := newSQLite(t, consumer.Config{Scope: func(m *consumer.Message) string {
		t := m.Header["Tenant"]
		return t[0] // panics without the header
	}, FingerprintHeaders: []string{"Tenant"}})
	ctx := context.Background()
	runs := 0
	h := func(ctx context.Context, m *consumer.Message) ([]byte, error) {
		runs++
		_, err := sqlitestore.Tx(ctx).ExecContext(ctx, `INSERT INTO orders VALUES (?)`, m.ID)
		return nil, err
	}
	var out consumer.Outcome
	func() {
		defer func() {
			if v := recover(); v != nil {
				t.Fatalf("Process panicked with the Scope hook: %v", v)
			}
		}()
		msg := &consumer.Message{ID: "o-1", Payload: []byte("{}"), Delivery: 1}
		out = p.Process(ctx, msg, h)
		if err := p.DeadLettered(ctx, msg, out); err != nil {
			t.Fatalf("DeadLettered: %v", err)
		}
	}()
	if out.Action != consumer.DeadLetter || runs != 0 || out.Err == nil || !strings.Contains(out.Err.Error(), "Config.Scope") {
		t.Fatalf("message the Scope hook panics on: %+v, %d runs; want it dead-lettered unrun, the error naming Config.Scope", out, runs)
	}
	if out := p.Process(ctx, &consumer.Message{ID: "o-2", Payload: []byte("{}"), Delivery: 1, Header: map[string][]string{"Tenant": {"t1"}}}, h); out.Reason != consumer.Executed {
		t.Fatalf("next message: %+v", out)
	}
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM orders`).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d rows (%v); want 1", n, err)
	}
}

// A fingerprinted header whose name matches several headers only
// case-insensitively (Tenant and tenant, FingerprintHeaders {"TENANT"}) gives
// one fingerprint every time: a redelivery is a duplicate, never a mismatch
// picked by map order.
func TestFingerprintHeaderCaseVariants(t *testing.T) {
	p, _, _ := newSQLite(t, consumer.Config{FingerprintHeaders: []string{"TENANT"}})
	ctx := context.Background()
	h := func(context.Context, *consumer.Message) ([]byte, error) { return nil, nil }
	hdr := func() map[string][]string {
		return map[string][]string{"Tenant": {"a"}, "tenant": {"b"}, "TeNaNt": {"c"}, "Other": {"x"}}
	}
	if out := p.Process(ctx, &consumer.Message{ID: "m", Payload: []byte("p"), Delivery: 1, Header: hdr()}, h); out.Reason != consumer.Executed {
		t.Fatalf("first: %+v", out)
	}
	for i := 0; i < 30; i++ {
		if out := p.Process(ctx, &consumer.Message{ID: "m", Payload: []byte("p"), Delivery: 2, Header: hdr()}, h); out.Reason != consumer.Duplicate {
			t.Fatalf("redelivery %d: %+v; want a duplicate", i+1, out)
		}
	}
	// And what they hold still counts: another value is a mismatch.
	other := hdr()
	other["tenant"] = []string{"z"}
	if out := p.Process(ctx, &consumer.Message{ID: "m", Payload: []byte("p"), Delivery: 2, Header: other}, h); out.Reason != consumer.Mismatch {
		t.Fatalf("other value: %+v; want a mismatch", out)
	}
}

// LegacyScope honours the records of earlier versions also when the
// Processor now fingerprints headers or names tenants: earlier versions
// fingerprinted the payload only ("m1:"), so that is what the legacy record
// is compared with.
func TestLegacyScopeWithFingerprintHeaders(t *testing.T) {
	_, s := sqliteOrders(t)
	ctx := context.Background()
	now := time.Now()
	tok := "legacy-token-xxxxxxxxxxxxxx"
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "orders", Key: "m1", Fingerprint: consumer.Fingerprint([]byte("x")), Token: tok, Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if err := s.Complete(ctx, "orders", "m1", tok, &idem.Response{Status: 200, Body: []byte("old")}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	runs := 0
	h := func(context.Context, *consumer.Message) ([]byte, error) { runs++; return nil, nil }
	p, err := consumer.New(s, consumer.Config{Name: "orders", LegacyScope: true, FingerprintHeaders: []string{"Source"}})
	if err != nil {
		t.Fatal(err)
	}
	msg := &consumer.Message{ID: "m1", Payload: []byte("x"), Delivery: 2, Header: map[string][]string{"Source": {"web"}}}
	if out := p.Process(ctx, msg, h); out.Reason != consumer.Duplicate || string(out.Result) != "old" || runs != 0 {
		t.Fatalf("message processed before the upgrade, FingerprintHeaders now set: %+v, %d runs; want a duplicate of the old record", out, runs)
	}
	// Copied forward under the new fingerprint: the next redelivery is a
	// duplicate in the namespace, another header value a mismatch.
	if out := p.Process(ctx, msg, h); out.Reason != consumer.Duplicate || runs != 0 {
		t.Fatalf("again: %+v", out)
	}
	if out := p.Process(ctx, &consumer.Message{ID: "m1", Payload: []byte("y"), Delivery: 2}, h); out.Reason != consumer.Mismatch {
		t.Fatalf("another payload: %+v; want a mismatch", out)
	}
	_ = errors.New
}

// mysqlKeyColumn is mysqlstore.MaxKeyLength, written out so that the consumer
// module does not require mysqlstore for one constant.
const mysqlKeyColumn = 255

// keyColumn refuses keys longer than 255 bytes, as mysqlstore does for its
// VARBINARY(255) key column (mysqlKeyColumn).
type keyColumn struct{ idem.Store }

func (s keyColumn) Claim(ctx context.Context, req idem.ClaimRequest) (*idem.Record, bool, error) {
	if len(req.Key) > mysqlKeyColumn {
		return nil, false, fmt.Errorf("the key is %d bytes, longer than the %d the key column holds", len(req.Key), mysqlKeyColumn)
	}
	return s.Store.Claim(ctx, req)
}

func (s keyColumn) Get(ctx context.Context, scope, key string, now time.Time) (*idem.Record, error) {
	if len(key) > mysqlKeyColumn {
		return nil, fmt.Errorf("the key is %d bytes, longer than the %d the key column holds", len(key), mysqlKeyColumn)
	}
	return s.Store.Get(ctx, scope, key, now)
}

// Attempt markers of a message whose ID is close to 255 bytes fit a 255-byte
// key column at every attempt number: marker 1000 of a 251-byte ID was 256
// bytes, which mysqlstore refuses, so a Permanent failure with MaxDeliveries
// 1000 could not mark its attempts used up. (In memory: 1000 claims on MariaDB
// under -race take longer than a test should.)
func TestAttemptMarkersFitTheKeyColumn(t *testing.T) {
	s := keyColumn{memstore.New(nil)}
	p, err := consumer.New(s, consumer.Config{Name: "long-ids", MaxDeliveries: 1000})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	id := strings.Repeat("k", 251)
	out := p.Process(ctx, &consumer.Message{ID: id, Payload: []byte("p"), Delivery: 1}, func(context.Context, *consumer.Message) ([]byte, error) {
		return nil, consumer.Permanent(errors.New("bad"))
	})
	if out.Reason != consumer.Poison || strings.Contains(out.Err.Error(), "mark the attempt") {
		t.Fatalf("%+v; want it dead-lettered with its attempts marked", out)
	}
	// Until DeadLettered, a redelivery finds the attempts used up.
	runs := 0
	if out := p.Process(ctx, &consumer.Message{ID: id, Payload: []byte("p")}, func(context.Context, *consumer.Message) ([]byte, error) { runs++; return nil, nil }); out.Reason != consumer.Poison || runs != 0 {
		t.Fatalf("redelivery: %+v, %d runs; want it dead-lettered again unrun", out, runs)
	}
}

// Setting FingerprintHeaders on a running consumer: a message processed (or
// in flight, its holder crashed) just before, redelivered just after, has a
// record with the payload-only fingerprint. It is the same message — acked as
// a duplicate, or run once its claim lapsed — not dead-lettered as a mismatch.
func TestFingerprintHeadersAddedToARunningConsumer(t *testing.T) {
	_, s := sqliteOrders(t)
	ctx := context.Background()
	now := time.Now()
	scope := consumer.StoredScope("orders", "")
	fp := consumer.Fingerprint([]byte("x"))
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: scope, Key: "done", Fingerprint: fp, Token: "before-done-xxxxxxxxxxx", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if err := s.Complete(ctx, scope, "done", "before-done-xxxxxxxxxxx", &idem.Response{Status: 200, Body: []byte("r")}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	// Claimed a minute ago with a 30 s lease by a process that crashed.
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: scope, Key: "crashed", Fingerprint: fp, Token: "before-crash-xxxxxxxxxx", Now: now.Add(-time.Minute), LeaseUntil: now.Add(-30 * time.Second), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatal(ok, err)
	}
	p, _ := consumer.New(s, consumer.Config{Name: "orders", FingerprintHeaders: []string{"Source"}})
	runs := 0
	h := func(context.Context, *consumer.Message) ([]byte, error) { runs++; return nil, nil }
	msg := func(id string) *consumer.Message {
		return &consumer.Message{ID: id, Payload: []byte("x"), Header: map[string][]string{"Source": {"web"}}}
	}
	if out := p.Process(ctx, msg("done"), h); out.Reason != consumer.Duplicate || string(out.Result) != "r" || runs != 0 {
		t.Fatalf("processed before the change: %+v, %d runs; want a duplicate", out, runs)
	}
	out := p.Process(ctx, msg("crashed"), h)
	if out.Action != consumer.Retry || runs != 0 {
		t.Fatalf("in flight before the change, holder crashed: %+v; want a retry, not a dead letter", out)
	}
	if out := p.Process(ctx, msg("crashed"), h); out.Reason != consumer.Executed || runs != 1 {
		t.Fatalf("its redelivery: %+v, %d runs; want it executed once", out, runs)
	}
	// Another payload under the ID is still a mismatch.
	if out := p.Process(ctx, &consumer.Message{ID: "done", Payload: []byte("y")}, h); out.Reason != consumer.Mismatch {
		t.Fatalf("another payload: %+v; want a mismatch", out)
	}
}

// LegacyScope and a message an earlier version was processing when it was
// stopped for the upgrade (its claim in flight, lease lapsed): the message
// runs now, once, instead of being retried until that record's TTL; one
// still under a live lease is retried.
func TestLegacyScopeInFlightWhenStopped(t *testing.T) {
	_, s := sqliteOrders(t)
	ctx := context.Background()
	now := time.Now()
	fp := consumer.Fingerprint([]byte("x"))
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "orders", Key: "stopped", Fingerprint: fp, Token: "old-version-stopped-xxxx", Now: now.Add(-time.Minute), LeaseUntil: now.Add(-30 * time.Second), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatal(ok, err)
	}
	if _, ok, err := s.Claim(ctx, idem.ClaimRequest{Scope: "orders", Key: "running", Fingerprint: fp, Token: "old-version-running-xxxx", Now: now, LeaseUntil: now.Add(time.Minute), ExpiresAt: now.Add(time.Hour)}); err != nil || !ok {
		t.Fatal(ok, err)
	}
	p, _ := consumer.New(s, consumer.Config{Name: "orders", LegacyScope: true})
	runs := 0
	h := func(context.Context, *consumer.Message) ([]byte, error) { runs++; return nil, nil }
	if out := p.Process(ctx, &consumer.Message{ID: "running", Payload: []byte("x"), Delivery: 2}, h); out.Reason != consumer.InFlight || runs != 0 {
		t.Fatalf("in flight under a live legacy lease: %+v; want a retry", out)
	}
	if out := p.Process(ctx, &consumer.Message{ID: "stopped", Payload: []byte("x"), Delivery: 2}, h); out.Reason != consumer.Executed || runs != 1 {
		t.Fatalf("in flight under a lapsed legacy lease: %+v, %d runs; want it executed", out, runs)
	}
	// The stopped process's late completion is fenced out.
	if err := s.Complete(ctx, "orders", "stopped", "old-version-stopped-xxxx", &idem.Response{Status: 200}, now, now.Add(time.Hour)); !errors.Is(err, idem.ErrLockLost) {
		t.Fatalf("late completion of the legacy claim: %v; want ErrLockLost", err)
	}
	if out := p.Process(ctx, &consumer.Message{ID: "stopped", Payload: []byte("x"), Delivery: 3}, h); out.Reason != consumer.Duplicate || runs != 1 {
		t.Fatalf("again: %+v; want a duplicate", out)
	}
}

// A Process whose context has ended (the consumer stopping) says so, instead
// of blaming the store.
func TestEndedContextIsNotAStoreFailure(t *testing.T) {
	p, _, _ := newSQLite(t, consumer.Config{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	runs := 0
	out := p.Process(ctx, &consumer.Message{ID: "m", Payload: []byte("p"), Delivery: 1}, func(context.Context, *consumer.Message) ([]byte, error) { runs++; return nil, nil })
	if out.Action != consumer.Retry || runs != 0 || out.Err == nil || strings.Contains(out.Err.Error(), "store failed") || !strings.Contains(out.Err.Error(), "context ended") {
		t.Fatalf("%+v, %d runs; want a retry whose error says the context ended, not that the store failed", out, runs)
	}
}
