package mysqlstore

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/internal/headerjson"
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
		if headerjson.ValidUTF8(h) != (len(b) == 0 || b[0] == '{') {
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

// The JSON headers are written by hand and, when no string needs an escape,
// read by hand: the writing is valid JSON equal as JSON to encoding/json's, and
// the reading gives what encoding/json gives, for what either writes (earlier
// versions used encoding/json, which escapes <, > and &) and for malformed
// input, on tricky and random headers.
func TestHeadersJSON(t *testing.T) {
	t.Parallel()
	cases := []http.Header{
		{"Content-Type": {"application/json"}, "Location": {"/orders/1"}},
		{"X-Q": {`a "quoted" \ back\slash`, "tab\there\r\nline", "\x01\x1f\x7f", "caf\u00e9 \u2028 \U0001f600", "", "<&>"}},
		{"X-Nul": {"nul\x00byte"}, "Empty": {}, "Nil": nil},
		{"Na\"me\\": {"v"}, "": {""}},
	}
	r := rand.New(rand.NewPCG(1, 2))
	alphabet := []string{"a", "\"", "\\", "\x00", "\x01", "\n", "\u00e9", "/", " ", "\U0001f600", "\u2028", "<", ":", ",", "[", "]", "{", "}"}
	word := func(max int) string {
		var b strings.Builder
		for range r.IntN(max) {
			b.WriteString(alphabet[r.IntN(len(alphabet))])
		}
		return b.String()
	}
	for range 500 {
		h := http.Header{}
		for range r.IntN(4) + 1 {
			var vs []string
			for range r.IntN(3) {
				vs = append(vs, word(8))
			}
			h[word(6)+"x"] = vs
		}
		cases = append(cases, h)
	}
	decodeRef := func(b []byte) (http.Header, error) {
		var h http.Header
		err := json.Unmarshal(b, &h)
		return h, err
	}
	for _, h := range cases {
		got := headerjson.AppendHeaders(nil, h)
		if !json.Valid(got) {
			t.Fatalf("AppendHeaders(%q) = %s: not valid JSON", h, got)
		}
		ref, _ := json.Marshal(h)
		var a, b any
		_ = json.Unmarshal(got, &a)
		_ = json.Unmarshal(ref, &b)
		// encoding/json writes a nil slice as null, which reads back as nil:
		// the same header.
		if fmt.Sprint(a) != fmt.Sprint(b) && !strings.Contains(string(ref), "null") {
			t.Fatalf("AppendHeaders(%q) = %s; encoding/json says %s", h, got, ref)
		}
		for _, enc := range [][]byte{got, ref} {
			want, _ := decodeRef(enc)
			back, err := decodeHeaders(enc)
			if err != nil || fmt.Sprintf("%q", back) != fmt.Sprintf("%q", want) {
				t.Fatalf("decodeHeaders(%s) = %q, %v; encoding/json says %q", enc, back, err, want)
			}
		}
	}
	for _, bad := range []string{`{"a":["b"]`, `{"a":["b"],}`, `{"a":["b"]}x`, `{"a":"b"}`, `{"a":[1]}`, `{"a":["b"] }`, `{"a":["b"],"a":["c"]}`, `{"a":["\u0041"]}`, `{"a":["` + "\xff" + `"]}`, `{"a":[],"b":[""]}`, `{"a":["x""]}`, `{:[]}`, `{"a":["b",]}`} {
		want, werr := decodeRef([]byte(bad))
		got, err := decodeHeaders([]byte(bad))
		if (err != nil) != (werr != nil) || (err == nil && fmt.Sprintf("%q", got) != fmt.Sprintf("%q", want)) {
			t.Errorf("decodeHeaders(%s) = %q, %v; encoding/json says %q, %v", bad, got, err, want, werr)
		}
	}
}

func BenchmarkHeadersJSON(b *testing.B) {
	h := http.Header{"Content-Type": {"application/json"}, "Location": {"/orders/12345"}}
	enc, _ := encodeHeaders(h)
	b.ReportAllocs()
	for b.Loop() {
		_, _ = encodeHeaders(h)
		_, _ = decodeHeaders(enc)
	}
}
