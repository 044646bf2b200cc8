// Package deploy holds what an operator loads next to a service protected by
// idem: grafana-dashboard.json (a Grafana dashboard) and prometheus-rules.yml
// (Prometheus alerting rules), both built on the metrics of package idemprom.
// Its test checks that they parse and name only metrics idemprom exports.
package deploy
