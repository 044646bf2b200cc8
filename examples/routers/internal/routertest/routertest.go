// Package routertest runs idem check against a router example over loopback.
package routertest

import (
	"context"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/checker"
)

// Check runs every case of idem check against url (the POST endpoint) as
// tenants "tenant-a" and "tenant-b" (bearer tokens), counting orders with
// countURL (a template with {{marker}}), and fails t when a case fails or is
// skipped.
func Check(t *testing.T, url, countURL string) {
	t.Helper()
	rep, err := checker.Run(context.Background(), checker.Options{
		URL:           url,
		Header:        http.Header{"Authorization": {"Bearer tenant-a"}},
		TenantBHeader: http.Header{"Authorization": {"Bearer tenant-b"}},
		CountURL:      countURL,
		Concurrency:   20,
		Rounds:        2,
		Timeout:       20 * time.Second,
	})
	if err != nil {
		t.Fatal(err)
	}
	var sb strings.Builder
	_ = rep.WriteTable(&sb)
	if rep.Failed() || rep.Count(checker.Skip) > 0 {
		t.Fatalf("idem check failed or skipped a case:\n%s", sb.String())
	}
	t.Logf("idem check:\n%s", sb.String())
	twoAuthorizationLines(t, url)
}

// twoAuthorizationLines: a request with two Authorization lines names no
// tenant (401): taking either would let whoever added the other choose it.
func twoAuthorizationLines(t *testing.T, url string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(`{"cart_id":"two-auth","total_cents":1}`))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", "two-authorization-lines")
	req.Header.Add("Authorization", "Bearer tenant-a")
	req.Header.Add("Authorization", "Bearer tenant-b")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusUnauthorized {
		t.Fatalf("a request with two Authorization lines: %d, want 401", resp.StatusCode)
	}
}
