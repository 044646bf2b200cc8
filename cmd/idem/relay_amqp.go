package main

import (
	"fmt"
	"log/slog"
	"net/url"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/amqp"
)

// checkAMQPURL says what is wrong with an --amqp value.
func checkAMQPURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "amqp" && u.Scheme != "amqps") || u.Host == "" {
		return fmt.Sprintf("--amqp %q is not an AMQP URL; use amqp://USER:PASS@HOST:PORT/VHOST, such as amqp://guest:guest@127.0.0.1:5672/", amqpDisplay(raw))
	}
	return ""
}

// amqpDisplay is an AMQP URL without its password, for messages.
func amqpDisplay(raw string) string { return natsDisplay(raw) }

// amqpPublisher returns the RabbitMQ publisher (it dials on its first
// publication, and again after a lost connection) and its Close.
func amqpPublisher(raw, exchange string, _ *slog.Logger) (outbox.Publisher, func(), error) {
	p, err := amqp.NewPublisher(amqp.Config{URL: raw, Exchange: exchange})
	if err != nil {
		return nil, nil, err
	}
	return p, func() { _ = p.Close() }, nil
}
