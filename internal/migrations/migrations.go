// Package migrations loads the versioned SQL migration files that the SQL stores
// embed (NNN_name.up.sql and NNN_name.down.sql). Each store applies them its own
// way; this package only finds, checks and orders them.
package migrations

import (
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"strings"
)

// File is one up migration.
type File struct {
	// Version is the number the file name starts with (001 → 1).
	Version int
	// Name is the file name, for example "001_create.up.sql".
	Name string
	// SQL is the file's text.
	SQL string
}

// Up returns the up migrations at the root of fsys ordered by version. A file
// whose name does not start with a positive version number, or two files with one
// version, is an error.
func Up(fsys fs.FS) ([]File, error) {
	names, err := fs.Glob(fsys, "*.up.sql")
	if err != nil {
		return nil, err
	}
	files := make([]File, 0, len(names))
	for _, name := range names {
		num, _, ok := strings.Cut(name, "_")
		v, err := strconv.Atoi(num)
		if !ok || err != nil || v <= 0 {
			return nil, fmt.Errorf("migration file %q is not named NNN_name.up.sql", name)
		}
		b, err := fs.ReadFile(fsys, name)
		if err != nil {
			return nil, err
		}
		files = append(files, File{Version: v, Name: name, SQL: string(b)})
	}
	slices.SortFunc(files, func(a, b File) int { return a.Version - b.Version })
	for i := 1; i < len(files); i++ {
		if files[i].Version == files[i-1].Version {
			return nil, fmt.Errorf("migration files %q and %q have the same version", files[i-1].Name, files[i].Name)
		}
	}
	return files, nil
}

// Sub returns the subtree dir of f, the folder an embed.FS keeps its files in. It
// panics when dir is not a valid path, which is a programming error.
func Sub(f fs.FS, dir string) fs.FS {
	sub, err := fs.Sub(f, dir)
	if err != nil {
		panic(err)
	}
	return sub
}
