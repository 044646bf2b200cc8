package idem

import (
	"context"
	"net/http"
)

type scopeKey struct{}

// WithScope returns a copy of ctx that carries scope, the tenant or principal an
// authentication middleware in front of idem has established. The default
// Config.ScopeFunc reads it back, so that two tenants never share a key.
func WithScope(ctx context.Context, scope string) context.Context {
	return context.WithValue(ctx, scopeKey{}, scope)
}

// ScopeFrom returns the scope stored in ctx by WithScope, or "" when there is none.
func ScopeFrom(ctx context.Context) string {
	s, _ := ctx.Value(scopeKey{}).(string)
	return s
}

// ScopeFromContext is the default Config.ScopeFunc: it returns
// ScopeFrom(r.Context()). Requests that no authentication middleware has scoped
// all share the scope "".
func ScopeFromContext(r *http.Request) string {
	return ScopeFrom(r.Context())
}
