// Package idemslog is an idem.Observer that logs every outcome with log/slog,
// with the same attribute names everywhere:
//
//	idem.outcome     executed, replayed, in_flight, mismatch, rejected, store_error,
//	                 lease_lost, released or taken_over
//	idem.key_hash    idemobs.KeyHash of the scope and key (16 hex characters):
//	                 the same key in two scopes gives two hashes; absent when
//	                 the request was rejected before its key was read
//	idem.scope_hash  idemobs.Hash of the scope; absent for the empty scope
//	idem.status      the status sent, when one was
//	idem.took        time since the request reached idem (a duration)
//	idem.err         the error behind the outcome, when there is one, with
//	                 the key and scope in it replaced (idemobs.Redact) unless
//	                 Config.RawKeys
//	idem.key, idem.scope  the raw key and scope, only with Config.RawKeys
//
// A wait for a running request's outcome (Config.InFlightWait) is logged as
// "idem waited" with idem.wait (replayed, timed_out, hung_up, retried, full)
// and idem.waited (how long), before the request's own record.
//
// Levels (DefaultLevel): executed, replayed and waited at Debug; in_flight, mismatch,
// rejected, released and taken_over at Info; lease_lost, and a release that
// failed, at Warn; store_error at Error.
//
//	protect, err := idem.New(store, &idem.Config{Observer: idemslog.New(&idemslog.Config{Logger: logger})})
package idemslog

import (
	"context"
	"log/slog"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/idemobs"
)

// Config configures the Observer. A nil *Config means all defaults.
type Config struct {
	// Logger receives the records. Defaults to slog.Default() at the time of
	// each event.
	Logger *slog.Logger
	// Level chooses the level of an event's record. Defaults to DefaultLevel.
	Level func(e idem.Event) slog.Level
	// RawKeys adds the raw key and scope (idem.key, idem.scope) to every record.
	// Keys and scopes come from clients and may identify them: leave it off
	// unless the logs are as protected as the data. Defaults to false: hashes
	// only.
	RawKeys bool
}

// DefaultLevel is the level of an event's record unless Config.Level says
// otherwise.
func DefaultLevel(e idem.Event) slog.Level {
	switch e.Kind {
	case idem.EventExecuted, idem.EventReplayed, idem.EventClaimed, idem.EventWaited:
		return slog.LevelDebug
	case idem.EventStoreError:
		return slog.LevelError
	case idem.EventLeaseLost:
		return slog.LevelWarn
	case idem.EventReleased:
		if e.Err != nil {
			return slog.LevelWarn
		}
	}
	return slog.LevelInfo
}

// Observer logs idem's events. It implements idem.Observer.
type Observer struct {
	logger *slog.Logger
	level  func(idem.Event) slog.Level
	raw    bool
}

// New returns an Observer configured by cfg.
func New(cfg *Config) *Observer {
	o := &Observer{level: DefaultLevel}
	if cfg != nil {
		o.logger, o.raw = cfg.Logger, cfg.RawKeys
		if cfg.Level != nil {
			o.level = cfg.Level
		}
	}
	return o
}

// Observe logs e, when its level is enabled.
func (o *Observer) Observe(ctx context.Context, e idem.Event) {
	logger := o.logger
	if logger == nil {
		logger = slog.Default()
	}
	level := o.level(e)
	if !logger.Enabled(ctx, level) {
		return
	}
	var buf [11]slog.Attr
	attrs := append(buf[:0], slog.String("idem.outcome", e.Kind.String()))
	if e.Key != "" { // a request rejected before its key was read has none
		attrs = append(attrs, slog.String("idem.key_hash", idemobs.KeyHash(e.Scope, e.Key)))
	}
	if e.Scope != "" {
		attrs = append(attrs, slog.String("idem.scope_hash", idemobs.Hash(e.Scope)))
	}
	attrs = append(attrs, slog.Duration("idem.took", e.Took))
	if e.Status != 0 {
		attrs = append(attrs, slog.Int("idem.status", e.Status))
	}
	if e.Kind == idem.EventWaited {
		attrs = append(attrs, slog.String("idem.wait", e.Wait.String()), slog.Duration("idem.waited", e.Waited))
	}
	if e.Err != nil {
		msg := e.Err.Error()
		if !o.raw { // store errors name the key
			msg = idemobs.Redact(msg, e.Key, e.Scope)
		}
		attrs = append(attrs, slog.String("idem.err", msg))
	}
	if o.raw {
		attrs = append(attrs, slog.String("idem.key", e.Key), slog.String("idem.scope", e.Scope))
	}
	logger.LogAttrs(ctx, level, "idem "+e.Kind.String(), attrs...)
}
