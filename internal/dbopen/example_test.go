package dbopen_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/idemkit/idem/internal/dbopen"
)

func ExampleParseDB() {
	for _, raw := range []string{
		"sqlite:idem-demo.db",
		"postgres://app:secret@db.internal:5432/shop",
		"mysql://root@127.0.0.1:3306/test",
		"x://foo",
	} {
		t, err := dbopen.ParseDB(raw)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println(t.Dialect, t.Display)
	}
	// Output:
	// sqlite sqlite:idem-demo.db
	// postgres postgres://app:xxxxx@db.internal:5432/shop
	// mysql mysql://root@127.0.0.1:3306/test
	// --db: unknown scheme "x"; use sqlite:PATH, postgres://… or mysql://…
}

func ExampleOpen() {
	dir, _ := os.MkdirTemp("", "dbopen-example")
	defer os.RemoveAll(dir)
	h, err := dbopen.Open(context.Background(), dbopen.Options{DB: "sqlite:" + filepath.Join(dir, "shop.db")})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer h.Close()
	if err := h.Migrate(context.Background()); err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("one transaction for order and answer:", h.Transactional())
	// Output:
	// one transaction for order and answer: true
}
