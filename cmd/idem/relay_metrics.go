package main

import (
	"github.com/idemkit/idem/idemprom"
	"github.com/idemkit/idem/outbox"
	"github.com/prometheus/client_golang/prometheus"
)

// relayMetrics returns the relay's Prometheus metrics (idemprom.Outbox:
// idem_outbox_published_total, idem_outbox_lag_seconds,
// idem_outbox_pending, idem_outbox_oldest_pending_age_seconds, …) on reg.
func relayMetrics(reg prometheus.Registerer) (outbox.Observer, error) {
	return idemprom.NewOutbox(reg, nil)
}
