package main

import (
	"errors"
	"fmt"
	"log/slog"
	"net/url"

	"github.com/idemkit/idem/outbox"
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

// amqpPublisher connects to RabbitMQ.
func amqpPublisher(raw, exchange string, logger *slog.Logger) (outbox.Publisher, func(), error) {
	return nil, nil, errors.New("--amqp: the RabbitMQ publisher is not built in yet; use --nats")
}
