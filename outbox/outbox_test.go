package outbox_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/memstore"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/outboxtest"
)

// TestMessageIDStable pins MessageID: the IDs of events already published
// must never change with a release.
func TestMessageIDStable(t *testing.T) {
	t.Parallel()
	if got := outbox.MessageID("tenant-1", "order-42", "order.created"); got != outbox.MessageID("tenant-1", "order-42", "order.created") || len(got) != 64 {
		t.Fatalf("MessageID not deterministic: %s", got)
	}
	// The construction, spelled out so that any implementation can check it:
	// hex(SHA-256("idem/outbox/message-id/v1" || for each of scope, key, name:
	// uint64 big-endian length || bytes)).
	if got := outbox.MessageID("tenant-1", "order-42", "order.created"); got != "4100b7836331a13637c53341f52bfe88b2e56aad1237ff59397de5ca81a3d6c1" {
		t.Fatalf("MessageID changed: %s", got)
	}
	for _, c := range [][2][3]string{
		{{"a", "bc", ""}, {"ab", "c", ""}},
		{{"", "k", "n"}, {"k", "", "n"}},
		{{"s", "k", "n1"}, {"s", "k", "n2"}},
	} {
		if outbox.MessageID(c[0][0], c[0][1], c[0][2]) == outbox.MessageID(c[1][0], c[1][1], c[1][2]) {
			t.Fatalf("MessageID%v == MessageID%v", c[0], c[1])
		}
	}
	if id := outbox.MessageID("s", "secret-key", "n"); strings.Contains(id, "secret") {
		t.Fatal("the ID reveals the key")
	}
}

func TestPrepareHostile(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ok := outbox.Message{ID: "id-1", Subject: "orders.created", Payload: []byte("{}")}
	if _, err := outbox.Prepare(ctx, ok, 0); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		mod  func(*outbox.Message)
		want error
		text string
	}{
		{"no ID outside idem", func(m *outbox.Message) { m.ID = "" }, outbox.ErrNoID, "set Message.ID"},
		{"empty subject", func(m *outbox.Message) { m.Subject = "" }, outbox.ErrInvalid, "Subject is empty"},
		{"subject with space", func(m *outbox.Message) { m.Subject = "orders created" }, outbox.ErrInvalid, "Subject"},
		{"subject with NUL", func(m *outbox.Message) { m.Subject = "orders\x00" }, outbox.ErrInvalid, "Subject"},
		{"subject too long", func(m *outbox.Message) { m.Subject = strings.Repeat("s", 256) }, outbox.ErrInvalid, "Subject"},
		{"subject not UTF-8", func(m *outbox.Message) { m.Subject = "orders.\xff" }, outbox.ErrInvalid, "Subject"},
		{"JetStream API subject", func(m *outbox.Message) { m.Subject = "$JS.API.STREAM.DELETE.ORDERS" }, outbox.ErrInvalid, "reserved"},
		{"system subject", func(m *outbox.Message) { m.Subject = "$SYS.REQ.SERVER.PING" }, outbox.ErrInvalid, "reserved"},
		{"KV subject", func(m *outbox.Message) { m.Subject = "$KV.bucket.key" }, outbox.ErrInvalid, "reserved"},
		{"object store subject", func(m *outbox.Message) { m.Subject = "$O.bucket.C.x" }, outbox.ErrInvalid, "reserved"},
		{"any $ subject", func(m *outbox.Message) { m.Subject = "$orders" }, outbox.ErrInvalid, "reserved"},
		{"inbox subject", func(m *outbox.Message) { m.Subject = "_INBOX.abc" }, outbox.ErrInvalid, "reserved"},
		{"ID with NUL", func(m *outbox.Message) { m.ID = "a\x00b" }, outbox.ErrInvalid, "ID"},
		{"ID with space", func(m *outbox.Message) { m.ID = "a b" }, outbox.ErrInvalid, "ID"},
		{"ID too long", func(m *outbox.Message) { m.ID = strings.Repeat("i", 256) }, outbox.ErrInvalid, "ID"},
		{"payload too large", func(m *outbox.Message) { m.Payload = make([]byte, outbox.DefaultMaxPayload+1) }, outbox.ErrTooLarge, "at most 1028096"},
		{"header name with colon", func(m *outbox.Message) { m.Headers = map[string]string{"X:Y": "v"} }, outbox.ErrInvalid, "header name"},
		{"header name with space", func(m *outbox.Message) { m.Headers = map[string]string{"X Y": "v"} }, outbox.ErrInvalid, "header name"},
		{"empty header name", func(m *outbox.Message) { m.Headers = map[string]string{"": "v"} }, outbox.ErrInvalid, "header name"},
		{"header value with CRLF", func(m *outbox.Message) { m.Headers = map[string]string{"X-A": "v\r\nX-Evil: 1"} }, outbox.ErrInvalid, "control characters"},
		{"header value with NUL", func(m *outbox.Message) { m.Headers = map[string]string{"X-A": "v\x00"} }, outbox.ErrInvalid, "control characters"},
		{"header value not UTF-8", func(m *outbox.Message) { m.Headers = map[string]string{"X-A": "\xff"} }, outbox.ErrInvalid, "UTF-8"},
		{"header value too long", func(m *outbox.Message) {
			m.Headers = map[string]string{"X-A": strings.Repeat("v", outbox.MaxHeaderValue+1)}
		}, outbox.ErrInvalid, "at most"},
		{"Nats- header", func(m *outbox.Message) { m.Headers = map[string]string{"Nats-Msg-Id": "other"} }, outbox.ErrInvalid, "JetStream"},
		{"partition with NUL", func(m *outbox.Message) { m.PartitionKey = "p\x00" }, outbox.ErrInvalid, "PartitionKey"},
	}
	for _, c := range cases {
		m := ok
		c.mod(&m)
		_, err := outbox.Prepare(ctx, m, 0)
		if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.text) {
			t.Errorf("%s: %v, want %v saying %q", c.name, err, c.want, c.text)
		}
	}
	many := map[string]string{}
	for i := range outbox.MaxHeaders + 1 {
		many[strings.Repeat("h", i+1)] = "v"
	}
	m := ok
	m.Headers = many
	if _, err := outbox.Prepare(ctx, m, 0); !errors.Is(err, outbox.ErrInvalid) {
		t.Errorf("%d headers: %v", len(many), err)
	}
	big := map[string]string{}
	for i := range 5 {
		big[strings.Repeat("h", i+1)] = strings.Repeat("v", outbox.MaxHeaderValue)
	}
	m = ok
	m.Headers = big
	if _, err := outbox.Prepare(ctx, m, 0); !errors.Is(err, outbox.ErrInvalid) || !strings.Contains(err.Error(), "names and values together") {
		t.Errorf("headers over MaxHeaderBytes: %v", err)
	}
	m = ok
	m.Payload = make([]byte, 101)
	if _, err := outbox.Prepare(ctx, m, 100); !errors.Is(err, outbox.ErrTooLarge) {
		t.Errorf("payload over a configured 100: %v", err)
	}
	m = ok
	m.Payload = []byte("binary \x00\xff is fine")
	m.Headers = map[string]string{"X-Tab": "a\tb", "X-Unicode": "café"}
	if _, err := outbox.Prepare(ctx, m, 0); err != nil {
		t.Errorf("binary payload, tab and UTF-8 in headers: %v", err)
	}
}

// TestPrepareInRequest: inside a request idem executes, ID and partition
// default to the request's scope and key.
func TestPrepareInRequest(t *testing.T) {
	t.Parallel()
	store := memstore.New(nil)
	defer store.Close()
	mw, err := idem.New(store, nil)
	if err != nil {
		t.Fatal(err)
	}
	var got outbox.Message
	var perr error
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got, perr = outbox.Prepare(r.Context(), outbox.Message{Name: "order.created", Subject: "orders"}, 0)
		w.WriteHeader(201)
	}))
	req := httptest.NewRequest("POST", "/orders", strings.NewReader("{}"))
	req.Header.Set("Idempotency-Key", "k-1")
	req = req.WithContext(idem.WithScope(req.Context(), "tenant-a"))
	h.ServeHTTP(httptest.NewRecorder(), req)
	if perr != nil {
		t.Fatal(perr)
	}
	if got.ID != outbox.MessageID("tenant-a", "k-1", "order.created") || got.PartitionKey != outbox.PartitionOf("tenant-a", "k-1") {
		t.Fatalf("defaults in a request: %+v", got)
	}
	out, err := outbox.Prepare(context.Background(), outbox.Message{ID: "x", Subject: "s"}, 0)
	if err != nil || out.PartitionKey != "x" {
		t.Fatalf("outside a request the partition defaults to the ID: %+v %v", out, err)
	}
}

// TestSuiteOnMemory runs the conformance suite on the in-memory Source the
// unit tests use, so that they test against the same rules.
func TestSuiteOnMemory(t *testing.T) {
	outboxtest.Run(t, outboxtest.Harness{
		New: func(*testing.T) outbox.Source { return &memSource{} },
		Enqueue: func(_ context.Context, src outbox.Source, msgs ...outbox.Message) error {
			for i := range msgs {
				m, err := outbox.Prepare(context.Background(), msgs[i], 0)
				if err != nil {
					return err
				}
				msgs[i] = m
			}
			src.(*memSource).add(msgs...)
			return nil
		},
	})
}

type recorder struct {
	outbox.NopObserver
	mu                               sync.Mutex
	published, failed, dead, batches int
	reasons                          []string
	retryIns                         []time.Duration
}

func (r *recorder) Published(*outbox.Stored, time.Duration) {
	r.mu.Lock()
	r.published++
	r.mu.Unlock()
}
func (r *recorder) Failed(_ *outbox.Stored, _ error, in time.Duration) {
	r.mu.Lock()
	r.failed++
	r.retryIns = append(r.retryIns, in)
	r.mu.Unlock()
}
func (r *recorder) DeadLettered(_ *outbox.Stored, reason string) {
	r.mu.Lock()
	r.dead++
	r.reasons = append(r.reasons, reason)
	r.mu.Unlock()
}
func (r *recorder) Batch(int, time.Duration) { r.mu.Lock(); r.batches++; r.mu.Unlock() }

// TestRelayOutcomes: a permanent failure is dead-lettered with its reason
// and the next message of its partition follows; a transient one is retried
// with a backoff that never exceeds MaxBackoff; a panicking publisher is a
// transient failure, not a crash.
func TestRelayOutcomes(t *testing.T) {
	t.Parallel()
	src := &memSource{}
	src.add(
		outbox.Message{ID: "big", Subject: "s", PartitionKey: "A"},
		outbox.Message{ID: "after-big", Subject: "s", PartitionKey: "A"},
		outbox.Message{ID: "down", Subject: "s", PartitionKey: "B"},
		outbox.Message{ID: "panic", Subject: "s", PartitionKey: "C"},
	)
	var downs, panics atomic.Int32
	pub := outbox.PublisherFunc(func(_ context.Context, m *outbox.Stored) error {
		switch m.ID {
		case "big":
			return outbox.Permanent(errors.New("maximum payload exceeded"))
		case "down":
			if downs.Add(1) <= 6 {
				return errors.New("connection refused")
			}
		case "panic":
			if panics.Add(1) == 1 {
				panic("publisher bug")
			}
		}
		return nil
	})
	rec := &recorder{}
	r := &outbox.Relay{Source: src, Publisher: pub, Observer: rec, PollInterval: time.Millisecond,
		MinBackoff: time.Millisecond, MaxBackoff: 8 * time.Millisecond, StatsInterval: -1}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	go func() {
		for {
			st, _ := src.Stats(ctx)
			if st.Pending == 0 || ctx.Err() != nil {
				cancel()
				return
			}
			time.Sleep(time.Millisecond)
		}
	}()
	if err := r.Run(ctx); err != nil {
		t.Fatal(err)
	}
	rec.mu.Lock()
	defer rec.mu.Unlock()
	if rec.published != 3 || rec.dead != 1 || rec.failed != 7 || !strings.Contains(rec.reasons[0], "maximum payload exceeded") {
		t.Fatalf("published %d, dead %d %v, failed %d", rec.published, rec.dead, rec.reasons, rec.failed)
	}
	for _, in := range rec.retryIns {
		if in > 8*time.Millisecond || in <= 0 {
			t.Fatalf("retry in %v, outside (0, MaxBackoff]", in)
		}
	}
	if len(src.dead) != 1 || src.dead[0].ID != "big" {
		t.Fatalf("dead letters %v", src.dead)
	}
}

// TestRelayMisconfigured: Run without Source or Publisher says what is
// missing.
func TestRelayMisconfigured(t *testing.T) {
	t.Parallel()
	err := (&outbox.Relay{}).Run(context.Background())
	if err == nil || !strings.Contains(err.Error(), "needs a Source") {
		t.Fatal(err)
	}
}

// TestRelayPublishTimeout: a publication the broker never confirms ends at
// PublishTimeout (well inside the lease) and is retried.
func TestRelayPublishTimeout(t *testing.T) {
	t.Parallel()
	src := &memSource{}
	src.add(outbox.Message{ID: "slow", Subject: "s"})
	var calls atomic.Int32
	pub := outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
		if calls.Add(1) == 1 {
			<-ctx.Done()
			return ctx.Err()
		}
		return nil
	})
	r := &outbox.Relay{Source: src, Publisher: pub, PublishTimeout: 50 * time.Millisecond, LeaseDuration: time.Second, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond}
	start := time.Now()
	if _, err := r.PublishBatch(context.Background()); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > 500*time.Millisecond {
		t.Fatalf("the unconfirmed publication took %v", d)
	}
	time.Sleep(5 * time.Millisecond)
	if _, err := r.PublishBatch(context.Background()); err != nil {
		t.Fatal(err)
	}
	if st, _ := src.Stats(context.Background()); st.Pending != 0 || calls.Load() != 2 {
		t.Fatalf("pending %d after %d calls", st.Pending, calls.Load())
	}
}

// TestRelayCancelledMidBatch: a relay whose context ends while publications
// hang returns promptly and releases what it had not published, so another
// relay publishes it at once (not a lease later), with the same ID.
func TestRelayCancelledMidBatch(t *testing.T) {
	t.Parallel()
	src := &memSource{}
	for i := range 10 {
		src.add(outbox.Message{ID: string(rune('a' + i)), Subject: "s", PartitionKey: string(rune('a' + i))})
	}
	var published atomic.Int32
	hang := outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
		if m.ID < "f" {
			published.Add(1)
			return nil
		}
		<-ctx.Done()
		return ctx.Err()
	})
	ctx, cancel := context.WithCancel(context.Background())
	a := &outbox.Relay{Source: src, Publisher: hang, LeaseDuration: time.Minute, MinBackoff: time.Millisecond, MaxBackoff: time.Millisecond, StatsInterval: -1, Retention: -1}
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	for published.Load() < 5 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
	if st, _ := src.Stats(context.Background()); st.Pending != 5 {
		t.Fatalf("%d pending after the cancel, want 5", st.Pending)
	}
	var ids []string
	var mu sync.Mutex
	b := &outbox.Relay{Source: src, LeaseDuration: time.Minute, Publisher: outbox.PublisherFunc(func(_ context.Context, m *outbox.Stored) error {
		mu.Lock()
		ids = append(ids, m.ID)
		mu.Unlock()
		return nil
	})}
	time.Sleep(5 * time.Millisecond)
	start := time.Now()
	if n, err := b.PublishBatch(context.Background()); err != nil || n != 5 {
		t.Fatalf("the second relay leased %d (%v), want the 5 the first released", n, err)
	}
	if time.Since(start) > time.Second || len(ids) != 5 {
		t.Fatalf("published %v", ids)
	}
}

// TestWithKey: outside idem, WithKey gives the defaults a key; the error
// without it names WithKey.
func TestWithKey(t *testing.T) {
	t.Parallel()
	ctx := outbox.WithKey(context.Background(), "consumer/orders", "msg-17")
	m, err := outbox.Prepare(ctx, outbox.Message{Name: "invoice.issued", Subject: "invoices"}, 0)
	if err != nil || m.ID != outbox.MessageID("consumer/orders", "msg-17", "invoice.issued") || m.PartitionKey != outbox.PartitionOf("consumer/orders", "msg-17") {
		t.Fatalf("%+v %v", m, err)
	}
	_, err = outbox.Prepare(context.Background(), outbox.Message{Subject: "s"}, 0)
	if !strings.Contains(err.Error(), "outbox.WithKey") {
		t.Fatal(err)
	}
}

// TestRelayBlackHole: a broker that never answers (a black hole) costs each
// publication PublishTimeout, Concurrency at a time; the ones the lease
// cannot cover any more are released unpublished, and no publication runs
// past the lease.
func TestRelayBlackHole(t *testing.T) {
	t.Parallel()
	src := &memSource{}
	for i := range 12 {
		src.add(outbox.Message{ID: string(rune('a' + i)), Subject: "s", PartitionKey: string(rune('a' + i))})
	}
	lease := 400 * time.Millisecond
	start := time.Now()
	var mu sync.Mutex
	var ends []time.Duration
	hole := outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
		<-ctx.Done()
		mu.Lock()
		ends = append(ends, time.Since(start))
		mu.Unlock()
		return ctx.Err()
	})
	rec := &recorder{}
	r := &outbox.Relay{Source: src, Publisher: hole, Observer: rec, Concurrency: 2, LeaseDuration: lease, PublishTimeout: 100 * time.Millisecond}
	if _, err := r.PublishBatch(context.Background()); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	for _, e := range ends {
		if e > lease {
			t.Fatalf("a publication ended %v after the lease began (lease %v)", e, lease)
		}
	}
	// 400 ms lease, 100 ms per publication, 2 at a time, the last ones
	// starting at least 150 ms before the lease ends: 4 to 6 tried.
	if len(ends) < 4 || len(ends) > 6 || rec.failed != 12 {
		t.Fatalf("%d publications tried, %d failures recorded", len(ends), rec.failed)
	}
	if st, _ := src.Stats(context.Background()); st.Pending != 12 {
		t.Fatalf("pending %d", st.Pending)
	}
}

// TestSameNameTwiceInARequest: two messages of one request with the same Name
// (an "item.added" per line item) get IDs of their own, the first the plain
// MessageID, numbered in the order they are enqueued, and a retry that runs
// the handler again gets the same IDs. Before, both got one ID, and the
// broker's duplicate window dropped the second.
func TestSameNameTwiceInARequest(t *testing.T) {
	t.Parallel()
	store := memstore.New(nil)
	defer store.Close()
	mw, err := idem.New(store, &idem.Config{KeepFunc: func(status int) bool { return status < 500 }})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var ids [][]string
	fail := true
	h := mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var got []string
		for _, name := range []string{"item.added", "item.added", "order.created", "item.added"} {
			m, err := outbox.Prepare(r.Context(), outbox.Message{Name: name, Subject: "orders"}, 0)
			if err != nil {
				t.Error(err)
			}
			got = append(got, m.ID)
		}
		// A message refused by the checks takes no number.
		if _, err := outbox.Prepare(r.Context(), outbox.Message{Name: "item.added", Subject: "$JS.API.x"}, 0); err == nil {
			t.Error("a reserved subject was accepted")
		}
		m, _ := outbox.Prepare(r.Context(), outbox.Message{Name: "item.added", Subject: "orders"}, 0)
		got = append(got, m.ID)
		// A message with an ID of its own takes no number either.
		_, _ = outbox.Prepare(r.Context(), outbox.Message{ID: "own", Name: "item.added", Subject: "orders"}, 0)
		mu.Lock()
		ids = append(ids, got)
		retry := fail
		fail = false
		mu.Unlock()
		if retry {
			w.WriteHeader(503) // not kept (KeepFunc): the retry runs the handler again
			return
		}
		w.WriteHeader(201)
	}))
	for range 2 {
		req := httptest.NewRequest("POST", "/orders", strings.NewReader("{}"))
		req.Header.Set("Idempotency-Key", "k-twice")
		req = req.WithContext(idem.WithScope(req.Context(), "tenant-a"))
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	if len(ids) != 2 {
		t.Fatalf("the handler ran %d times, want 2", len(ids))
	}
	want := []string{
		outbox.MessageID("tenant-a", "k-twice", "item.added"),
		outbox.NthMessageID("tenant-a", "k-twice", "item.added", 2),
		outbox.MessageID("tenant-a", "k-twice", "order.created"),
		outbox.NthMessageID("tenant-a", "k-twice", "item.added", 3),
		outbox.NthMessageID("tenant-a", "k-twice", "item.added", 4),
	}
	for attempt, got := range ids {
		for i := range want {
			if got[i] != want[i] {
				t.Errorf("attempt %d, message %d: ID %s, want %s", attempt+1, i+1, got[i], want[i])
			}
		}
	}
	seen := map[string]bool{}
	for _, id := range want {
		if seen[id] {
			t.Fatalf("ID %s given twice", id)
		}
		seen[id] = true
	}
	if outbox.NthMessageID("s", "k", "n", 1) != outbox.MessageID("s", "k", "n") || outbox.NthMessageID("s", "k", "n", 0) != outbox.MessageID("s", "k", "n") {
		t.Error("NthMessageID(…, 1) is not MessageID")
	}
	if outbox.NthMessageID("s", "k", "n", 2) == outbox.MessageID("s", "k", "n2") || outbox.NthMessageID("s", "k", "n2", 2) == outbox.NthMessageID("s", "k2", "n", 2) {
		t.Error("NthMessageID collides with another name's ID")
	}
}

// TestSameNameConcurrently: messages of one name enqueued from many
// goroutines of one handler at once get distinct IDs; under WithKey too.
func TestSameNameConcurrently(t *testing.T) {
	t.Parallel()
	ctx := outbox.WithKey(context.Background(), "consumer/orders", "msg-9")
	const n = 64
	ids := make([]string, n)
	var start, done sync.WaitGroup
	start.Add(1)
	for i := range n {
		done.Add(1)
		go func() {
			defer done.Done()
			start.Wait()
			m, err := outbox.Prepare(ctx, outbox.Message{Name: "line", Subject: "s"}, 0)
			if err != nil {
				t.Error(err)
			}
			ids[i] = m.ID
		}()
	}
	start.Done()
	done.Wait()
	seen := map[string]bool{}
	for _, id := range ids {
		if seen[id] {
			t.Fatalf("ID %s given twice", id)
		}
		seen[id] = true
	}
	for i := 1; i <= n; i++ {
		if !seen[outbox.NthMessageID("consumer/orders", "msg-9", "line", i)] {
			t.Fatalf("the %d-th message's ID is missing", i)
		}
	}
	// A new WithKey context numbers from 1 again.
	m, _ := outbox.Prepare(outbox.WithKey(context.Background(), "consumer/orders", "msg-9"), outbox.Message{Name: "line", Subject: "s"}, 0)
	if m.ID != outbox.MessageID("consumer/orders", "msg-9", "line") {
		t.Fatalf("a new WithKey context does not start from 1: %s", m.ID)
	}
}
