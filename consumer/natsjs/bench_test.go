package natsjs_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/consumer/internal/prooftest"
	"github.com/idemkit/idem/consumer/natsjs"
)

// BenchmarkDedupe consumes the same b.N messages from JetStream twice, on two
// durable consumers: once inserting each row in a transaction of its own and
// acknowledging (plain), once through the Processor (the row and the record in
// one transaction, then the ack). It reports both rates and their ratio,
// measured in one run against one store.
//
//	go test -run '^$' -bench Dedupe -benchtime 3000x ./consumer/natsjs/
func BenchmarkDedupe(b *testing.B) {
	for _, kind := range prooftest.Kinds {
		b.Run(kind, func(b *testing.B) {
			ctx := context.Background()
			env, err := prooftest.Open(ctx, prooftest.NewTarget(b, kind))
			if err != nil {
				b.Fatal(err)
			}
			defer env.Close(true)
			br := newBrokerB(b)
			n := b.N
			br.publishB(b, ids(n, "b"))
			p, err := consumer.New(env.Store, consumer.Config{Name: "bench"})
			if err != nil {
				b.Fatal(err)
			}
			run := func(name string, handle func(jetstream.Msg)) float64 {
				c, err := br.js.CreateOrUpdateConsumer(ctx, br.stream, jetstream.ConsumerConfig{Durable: name, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 30 * time.Second, MaxDeliver: -1, MaxAckPending: 1000})
				if err != nil {
					b.Fatal(err)
				}
				var done atomic.Int64
				all := make(chan struct{})
				start := time.Now()
				cc, err := c.Consume(func(m jetstream.Msg) {
					handle(m)
					if done.Add(1) == int64(n) {
						close(all)
					}
				})
				if err != nil {
					b.Fatal(err)
				}
				<-all
				took := time.Since(start)
				cc.Stop()
				return float64(n) / took.Seconds()
			}
			b.ResetTimer()
			plain := run("plain", func(m jetstream.Msg) {
				if err := env.InsertPlain(ctx, natsjs.Message(m, "")); err != nil {
					b.Error(err)
				}
				_ = m.Ack()
			})
			dedupe := run("dedupe", func(m jetstream.Msg) {
				if out, err := natsjs.Handle(ctx, p, m, env.Insert, nil); err != nil || out.Reason != consumer.Executed {
					b.Errorf("%+v %v", out, err)
				}
			})
			b.StopTimer()
			b.ReportMetric(plain, "plain-msg/s")
			b.ReportMetric(dedupe, "dedupe-msg/s")
			b.ReportMetric(dedupe/plain, "ratio")
			b.ReportMetric(0, "ns/op")
		})
	}
}
