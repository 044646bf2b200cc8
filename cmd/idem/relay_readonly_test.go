package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRelayReadOnlyMissingTable: --stats and --dead-letters read the
// outbox and create nothing: with a wrong --prefix (no such table) they exit
// 1 naming the table and what to check, instead of creating an empty outbox
// and reporting "0 pending". A second run fails the same way (nothing was
// created by the first).
func TestRelayReadOnlyMissingTable(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "ro.db")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	dbs := []struct{ name, db string }{{"sqlite", "sqlite:" + path}, {"postgres", newPostgresDatabase(t)}}
	for _, d := range dbs {
		for _, mode := range []string{"--stats", "--dead-letters"} {
			for run := 0; run < 2; run++ {
				code, out, errOut := runIdem(t, dir, nil, "relay", "--db", d.db, "--prefix", "wrong_", mode)
				if code != exitFailure || !strings.Contains(errOut, "wrong_"+outboxTableName) || !strings.Contains(errOut, "--prefix") || strings.Contains(out, "pending") {
					t.Errorf("%s: idem relay --prefix wrong_ %s (run %d): exit %d, stdout %q, stderr %q; want exit 1 naming the missing table", d.name, mode, run+1, code, out, errOut)
				}
			}
		}
	}
}
