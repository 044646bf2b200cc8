// Package idemobs holds what the observability adapters of idem share: a Store
// decorator that times every store operation (Store), an Observer that fans
// events out to several (Multi), and the short hash that stands for a key or a
// scope in logs and traces (Hash). It depends on the standard library only.
//
// Applications use it through idemprom (Prometheus), idemotel (OpenTelemetry)
// and idemslog (log/slog); it is public so that other backends can be written
// the same way.
package idemobs
