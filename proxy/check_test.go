package proxy_test

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/checker"
	"github.com/idemkit/idem/internal/pyorders"
	"github.com/idemkit/idem/proxy"
)

// TestCheckThroughTheProxyEachScope: `idem check` passes through the proxy in
// front of orders.py configured each way docs/proxy.md shows (a gateway's
// tenant header, bearer API keys, a verified JWT claim), over 10 race rounds,
// and the upstream executed exactly what the checker expected (its race and
// replay cases count the orders of each marker: one each).
func TestCheckThroughTheProxyEachScope(t *testing.T) {
	t.Parallel()
	iss := newIssuer(t, "k1")
	exp := time.Now().Add(time.Hour).Unix()
	tokA := iss.token(t, map[string]any{"tenant": "acme", "exp": exp})
	tokB := iss.token(t, map[string]any{"tenant": "globex", "exp": exp})
	jwtScope, err := proxy.JWTScope(proxy.JWTConfig{Keys: iss.jwks, Claim: "tenant"})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name  string
		scope proxy.Scope
		a, b  http.Header
	}{
		{"header", proxy.HeaderScope("X-Tenant-ID"), http.Header{"X-Tenant-Id": {"acme"}}, http.Header{"X-Tenant-Id": {"globex"}}},
		{"bearer", proxy.BearerScope(), http.Header{"Authorization": {"Bearer key-acme"}}, http.Header{"Authorization": {"Bearer key-globex"}}},
		{"jwt", jwtScope, http.Header{"Authorization": {"Bearer " + tokA}}, http.Header{"Authorization": {"Bearer " + tokB}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			app := pyorders.Start(t, "", "--delay-ms", "100")
			px := startProxy(t, app.URL, proxy.Config{Routes: []proxy.Route{{Pattern: "POST /orders"}}, Scope: c.scope})
			rep, err := checker.Run(context.Background(), checker.Options{
				URL:           px.url + "/orders",
				Body:          `{"cart_id":"{{marker}}","total_cents":1900}`,
				Header:        c.a,
				TenantBHeader: c.b,
				CountURL:      px.url + "/orders?cart_id={{marker}}",
				Concurrency:   20,
				Rounds:        10,
				Timeout:       30 * time.Second,
			})
			if err != nil {
				t.Fatal(err)
			}
			var sb strings.Builder
			_ = rep.WriteTable(&sb)
			if rep.Failed() || rep.Count(checker.Result("skip")) > 0 {
				t.Fatalf("idem check through the proxy (%s scope) failed or skipped a case:\n%s", c.name, sb.String())
			}
			if rc := rep.Case(checker.CaseRace); rc == nil || rc.Result != checker.Pass {
				t.Fatalf("race case: %+v\n%s", rc, sb.String())
			}
		})
	}
}
