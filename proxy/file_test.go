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

// TestLoadFileRefusesAmbiguity (issue 23 item 15): a file of several YAML
// documents, an empty file, and a size with two units are errors that say
// what to do (before: the first document was used silently, an empty file
// was a bare EOF, and "1MiBKiB" parsed or not depending on map order);
// "scope: none" is the explicit shared key space, and release_status a
// route's list.
func TestLoadFileRefusesAmbiguity(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for name, c := range map[string]struct{ text, want string }{
		"two.yaml":   {"upstream: http://a\ndb: sqlite:a.db\n---\nupstream: http://b\n", "more than one YAML document"},
		"empty.yaml": {"", "is empty"},
		"size.yaml":  {"upstream: http://a\nroutes:\n  - match: POST /x\n    max_request_body: 1MiBKiB\n", "not a size"},
		"scope.yaml": {"upstream: http://a\nscope: all\n", "write none"},
		"field.yaml": {"upstream: http://a\nscope: {headr: X}\n", "headr"},
		"cidr.yaml":  {"upstream: http://a\ntrust_forwarded: [10.0.0.0/33]\n", "not a CIDR"},
	} {
		_, err := proxy.LoadFile(writeFile(t, dir, name, c.text))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error saying %q", name, err, c.want)
		}
	}
	for range 20 { // map iteration order used to decide
		if _, err := proxy.ParseSize("1MiBKiB"); err == nil {
			t.Fatal(`ParseSize("1MiBKiB") succeeded`)
		}
	}
	f, err := proxy.LoadFile(writeFile(t, dir, "ok.yaml", "upstream: http://a\nscope: none\nroutes:\n  - match: POST /x\n    release_status: [429, 503]\n"))
	if err != nil {
		t.Fatal(err)
	}
	s, err := f.ProxyScope()
	if err != nil || s == nil {
		t.Fatalf("scope: none: %v %v", s, err)
	}
	rts, err := f.ProxyRoutes()
	if err != nil || len(rts) != 1 || len(rts[0].ReleaseStatus) != 2 || rts[0].ReleaseStatus[1] != 503 {
		t.Fatalf("routes %+v %v", rts, err)
	}
}
