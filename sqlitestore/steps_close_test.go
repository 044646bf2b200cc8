package sqlitestore_test

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem"
	"github.com/idemkit/idem/sqlitestore"
	"github.com/idemkit/idem/sqlitestore/embedded"
)

// openStepsFiles counts this process's open file descriptors on the steps
// file of path (the file, its -wal and -shm).
func openStepsFiles(t *testing.T, path string) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, e := range ents {
		target, err := os.Readlink(filepath.Join("/proc/self/fd", e.Name()))
		if err == nil && strings.HasPrefix(target, path+sqlitestore.StepsFileSuffix) {
			n++
		}
	}
	return n
}

// TestCloseClosesStepsFile: Store.Close closes the steps file sqlitestore
// opened beside the records' file once the last Store on the *sql.DB that
// used it is closed (not before: a Store still open keeps recording steps),
// and a Store used afterwards opens it again and finds its records. Failed
// before: the file stayed open until the *sql.DB was garbage.
func TestCloseClosesStepsFile(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("counts open files through /proc/self/fd")
	}
	t.Parallel()
	path := filepath.Join(t.TempDir(), "idem.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	ctx := context.Background()
	now := time.Now()
	begin := func(s *sqlitestore.Store, name string) {
		t.Helper()
		if _, began, err := s.BeginStep(ctx, idem.BeginStepRequest{Scope: "s", Key: "k", Name: name, Owner: "o",
			DerivedKey: "idem_" + name, Now: now, ExpiresAt: now.Add(time.Hour)}); err != nil || !began {
			t.Fatalf("BeginStep %s: %v %v", name, began, err)
		}
	}
	newStore := func() *sqlitestore.Store {
		s, err := sqlitestore.New(db, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		return s
	}
	a, b := newStore(), newStore()
	begin(a, "one")
	begin(b, "two")
	if n := openStepsFiles(t, path); n == 0 {
		t.Fatal("no file of the steps database is open after two steps; the test proves nothing")
	}
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	begin(b, "three") // b still open: its steps database too
	if err := b.Close(); err != nil {
		t.Fatal(err)
	}
	if n := openStepsFiles(t, path); n != 0 {
		t.Errorf("%d files of the steps database still open after every Store was closed, want 0", n)
	}
	// Used again: the steps database opens again, with its records.
	recs, err := a.GetSteps(ctx, "s", "k", now)
	if err != nil || len(recs) != 3 {
		t.Fatalf("GetSteps after Close: %d records, %v; want 3", len(recs), err)
	}
	begin(a, "four")
	if err := a.Close(); err != nil {
		t.Fatal(err)
	}
	if n := openStepsFiles(t, path); n != 0 {
		t.Errorf("%d files of the steps database open after the Store used again was closed, want 0", n)
	}
	if err := os.Remove(path + sqlitestore.StepsFileSuffix); err != nil {
		t.Fatal(err)
	}
}
