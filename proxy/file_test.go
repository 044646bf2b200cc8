package proxy_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/proxy"
)

func writeFile(t *testing.T, dir, name, text string) string {
	t.Helper()
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestLoadFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	jwks, _ := json.Marshal(newIssuer(t, "k1").jwks)
	writeFile(t, dir, "keys.json", string(jwks))
	p := writeFile(t, dir, "proxy.yaml", `
listen: 127.0.0.1:8081
upstream: http://127.0.0.1:3000
db: sqlite:keys.db
upstream_timeout: 5s
scope:
  jwt: {jwks_file: keys.json, claim: tenant, audience: orders}
routes:
  - match: POST /orders
    ttl: 2h
    lease: 10s
    stored_headers: [Content-Type, Location]
    max_request_body: 64KiB
    max_stored_body: 2MiB
    release_5xx: true
  - match: PATCH /orders/{id}
    key: optional
`)
	f, err := proxy.LoadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	routes, err := f.ProxyRoutes()
	if err != nil {
		t.Fatal(err)
	}
	want := proxy.Route{Pattern: "POST /orders", TTL: 2 * time.Hour, Lease: 10 * time.Second, StoredHeaders: []string{"Content-Type", "Location"}, MaxRequestBody: 64 << 10, MaxStoredBody: 2 << 20}
	if len(routes) != 2 || routes[0].Pattern != want.Pattern || routes[0].TTL != want.TTL || routes[0].Lease != want.Lease ||
		routes[0].MaxRequestBody != want.MaxRequestBody || routes[0].MaxStoredBody != want.MaxStoredBody || len(routes[0].StoredHeaders) != 2 ||
		!routes[0].Release5xx || routes[1].Release5xx ||
		!routes[1].KeyOptional || routes[1].Pattern != "PATCH /orders/{id}" {
		t.Errorf("routes = %+v", routes)
	}
	if time.Duration(f.UpstreamTimeout) != 5*time.Second || f.Upstream != "http://127.0.0.1:3000" || f.DB != "sqlite:keys.db" {
		t.Errorf("file = %+v", f)
	}
	if s, err := f.ProxyScope(); err != nil || s == nil {
		t.Errorf("ProxyScope: %v %v", s, err)
	}

	for name, text := range map[string]string{
		"typo":       "upstrem: http://x\n",
		"duration":   "routes: [{match: POST /x, ttl: forever}]\n",
		"size":       "routes: [{match: POST /x, max_stored_body: 1MB}]\n",
		"key":        "routes: [{match: POST /x, key: sometimes}]\n",
		"two scopes": "scope: {header: X-Tenant-ID, bearer: true}\n",
		"no jwks":    "scope: {jwt: {claim: sub}}\n",
	} {
		if _, err := proxy.LoadFile(writeFile(t, dir, "bad.yaml", text)); err == nil {
			t.Errorf("%s: accepted", name)
		} else if !strings.Contains(err.Error(), "bad.yaml") {
			t.Errorf("%s: error %q does not name the file", name, err)
		}
	}
}
