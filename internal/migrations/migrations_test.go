package migrations_test

import (
	"strings"
	"testing"
	"testing/fstest"

	"github.com/idemkit/idem/internal/migrations"
)

func TestUp(t *testing.T) {
	t.Parallel()
	files, err := migrations.Up(fstest.MapFS{
		"010_later.up.sql":    {Data: []byte("B")},
		"002_second.up.sql":   {Data: []byte("A")},
		"002_second.down.sql": {Data: []byte("x")},
		"README.md":           {Data: []byte("x")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 || files[0].Version != 2 || files[0].Name != "002_second.up.sql" || files[0].SQL != "A" || files[1].Version != 10 {
		t.Fatalf("Up = %+v, want 002 then 010", files)
	}
	for name, fsys := range map[string]fstest.MapFS{
		"no number":  {"create.up.sql": {}},
		"zero":       {"000_x.up.sql": {}},
		"duplicates": {"001_a.up.sql": {}, "001_b.up.sql": {}},
	} {
		if _, err := migrations.Up(fsys); err == nil || !strings.Contains(err.Error(), "migration files") && !strings.Contains(err.Error(), "NNN_name") {
			t.Errorf("%s: Up = %v, want an error naming the file", name, err)
		}
	}
}
