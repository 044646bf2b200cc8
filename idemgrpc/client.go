package idemgrpc

import (
	"context"
	"time"

	"github.com/google/uuid"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// ClientConfig configures UnaryClientInterceptor. The zero value keys every
// unary call with a random UUID.
type ClientConfig struct {
	// Methods lists the full method names ("/pkg.Service/Method") that get a key.
	// Empty: every unary call. A server that keys every call carrying a key
	// (Config.Methods empty) stores reads too if they carry one: list your
	// writes here then.
	Methods []string

	// NewKey makes the key of one call. Defaults to a random UUID (version 4).
	NewKey func() string
}

type keyCtx struct{}

// WithKey returns a copy of ctx whose calls use key instead of a new one: the
// key of an operation the caller already retries itself (across restarts, from a
// job record). A call whose outgoing metadata already holds MetadataKey keeps it.
// The key is sent whether or not the method is in ClientConfig.Methods: asking
// for a key is asking for it to be sent.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyCtx{}, key)
}

// UnaryClientInterceptor returns a client interceptor that gives each call one
// idempotency key, made before its first attempt, in the MetadataKey entry of
// the outgoing metadata. Every attempt of the call sends it: gRPC's retry policy
// and any retrying interceptor placed after this one (inner) resend the same
// metadata. Place retrying interceptors after it, never before: a retry that
// runs this interceptor again makes a new key, a new operation.
func UnaryClientInterceptor(cfg *ClientConfig) grpc.UnaryClientInterceptor {
	var methods map[string]bool
	newKey := uuid.NewString
	if cfg != nil {
		if len(cfg.Methods) > 0 {
			methods = make(map[string]bool, len(cfg.Methods))
			for _, m := range cfg.Methods {
				methods[m] = true
			}
		}
		if cfg.NewKey != nil {
			newKey = cfg.NewKey
		}
	}
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		key, _ := ctx.Value(keyCtx{}).(string)
		if methods != nil && !methods[method] && key == "" {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		if md, ok := metadata.FromOutgoingContext(ctx); ok && len(md.Get(MetadataKey)) > 0 {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		if key == "" {
			key = newKey()
		}
		return invoker(metadata.AppendToOutgoingContext(ctx, MetadataKey, key), method, req, reply, cc, opts...)
	}
}

// Replayed reports whether header, the response header of a call (read with
// the grpc.Header call option), marks the answer as a replay of an earlier
// execution.
func Replayed(header metadata.MD) bool {
	v := header.Get(ReplayedKey)
	return len(v) > 0 && v[0] == "true"
}

// RetryDelay returns the delay of the RetryInfo detail of err (an Aborted "key
// in use" or an Unavailable from the server interceptor), and whether it has one.
func RetryDelay(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}
