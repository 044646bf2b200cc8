package mysqlstore

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/http"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/internal/testenv"
)

type fieldErr struct{ Number uint16 }

func (e *fieldErr) Error() string { return fmt.Sprintf("Error %d", e.Number) }

func TestRetryable(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		want bool
	}{
		{&fieldErr{1213}, true},
		{fmt.Errorf("wrapped: %w", &fieldErr{1213}), true},
		{errors.Join(errors.New("x"), &fieldErr{1213}), true},
		{&fieldErr{1205}, false}, // lock wait timeout: something is slow, do not pile on
		{errors.New("Error 1213: looks like one but is not"), false},
		{nil, false},
	} {
		if got := retryable(tc.err); got != tc.want {
			t.Errorf("retryable(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	calls := 0
	err := retry(context.Background(), func() error {
		calls++
		if calls < 3 {
			return &fieldErr{1213}
		}
		return nil
	})
	if err != nil || calls != 3 {
		t.Errorf("retry = %v after %d calls, want nil after 3", err, calls)
	}
	calls = 0
	err = retry(context.Background(), func() error { calls++; return &fieldErr{1062} })
	if err == nil || calls != 1 {
		t.Errorf("retry of a non-deadlock error = %v after %d calls, want the error after 1", err, calls)
	}
}

// The driver's real deadlock error is recognised.
func TestRealDeadlockIsRetryable(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("mysql", testenv.MySQLDSN(testenv.MySQLURL(t)))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		if testenv.Required() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	table := fmt.Sprintf("idem_test_dl_%d", time.Now().UnixNano())
	if _, err := db.ExecContext(ctx, "CREATE TABLE `"+table+"` (id INT PRIMARY KEY, v INT) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	defer db.ExecContext(context.Background(), "DROP TABLE `"+table+"`")
	if _, err := db.ExecContext(ctx, "INSERT INTO `"+table+"` VALUES (1, 0), (2, 0)"); err != nil {
		t.Fatal(err)
	}
	a, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Rollback()
	b, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Rollback()
	upd := "UPDATE `" + table + "` SET v = v + 1 WHERE id = ?"
	if _, err := a.ExecContext(ctx, upd, 1); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ExecContext(ctx, upd, 2); err != nil {
		t.Fatal(err)
	}
	errs := make(chan error, 2)
	go func() { _, err := a.ExecContext(ctx, upd, 2); errs <- err }()
	time.Sleep(200 * time.Millisecond) // let a wait for b's lock
	go func() { _, err := b.ExecContext(ctx, upd, 1); errs <- err }()
	var deadlock error
	for range 2 {
		if err := <-errs; err != nil {
			deadlock = err
		}
	}
	if deadlock == nil {
		t.Fatal("no deadlock happened")
	}
	if !retryable(deadlock) {
		t.Fatalf("retryable(%v) = false, want true", deadlock)
	}
	if !retryable(fmt.Errorf("mysqlstore: %w", deadlock)) {
		t.Fatal("a wrapped deadlock is not retryable")
	}
}

// Stored headers round-trip in both encodings; a corrupt binary value is an
// error, never a panic.
func TestHeaderEncoding(t *testing.T) {
	t.Parallel()
	for _, h := range []http.Header{
		nil,
		{"Location": {"/orders/1"}, "X-Empty": {}, "X-Tags": {"<a>", "&"}},
		{"Location": {"/files/caf\xe9.pdf"}, "X-Empty": {}, "\xffname": {"", "\x00"}},
	} {
		b, err := encodeHeaders(h)
		if err != nil {
			t.Fatal(err)
		}
		if utf8Header(h) != (len(b) == 0 || b[0] == '{') {
			t.Errorf("headers %q encoded as %q: want JSON exactly when all of it is UTF-8", h, b)
		}
		got, err := decodeHeaders(b)
		if err != nil || fmt.Sprintf("%q", got) != fmt.Sprintf("%q", h) {
			t.Errorf("decode(encode(%q)) = %q, %v", h, got, err)
		}
		if len(b) > 0 && b[0] == binaryHeaders {
			for i := 1; i < len(b); i++ {
				if _, err := decodeHeaders(b[:i]); err == nil {
					t.Errorf("decoding %q, truncated to %d bytes, succeeded", b, i)
				}
			}
		}
	}
	if _, err := decodeHeaders([]byte{binaryHeaders, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01}); err == nil {
		t.Error("a huge count decoded")
	}
}
