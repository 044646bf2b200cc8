package bench

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/go-sql-driver/mysql"

	"github.com/idemkit/idem/internal/testenv"
)

// BenchmarkMySQLShapes times the statement sequences of one first-time request
// on MariaDB/MySQL, on a connection of their own, at 8 concurrent clients (no
// HTTP, no middleware), to find what mysqlstore's single transaction pays for
// beyond the hand-written reference's three round trips:
//
//   - hand: START TRANSACTION + INSERT of the key row; the order; UPDATE + COMMIT
//     (handMySQL's statements);
//
//   - hand+getlock: the same with GET_LOCK before and RELEASE_LOCK after, the
//     lock name computed on the server as mysqlstore computes it;
//
//   - idem: mysqlstore's statements (lock-free read, guard with GET_LOCK,
//     savepoint, expiry read; the order; savepoint check, record INSERT,
//     COMMIT, release);
//
//   - idem-nolock: idem without GET_LOCK and RELEASE_LOCK.
//
//     go test -run '^$' -bench MySQLShapes -count 4 ./internal/bench/
func BenchmarkMySQLShapes(b *testing.B) {
	mc, err := mysql.ParseDSN(testenv.MySQLDSN(testenv.MySQLURL(b)))
	if err != nil {
		b.Fatal(err)
	}
	mc.MultiStatements, mc.InterpolateParams = true, true
	db, err := sql.Open("mysql", mc.FormatDSN())
	if err != nil {
		b.Fatal(err)
	}
	defer db.Close()
	db.SetMaxOpenConns(16)
	db.SetMaxIdleConns(16)
	ctx := context.Background()
	tab := "shapes_" + randomHex(4)
	for _, q := range []string{
		"CREATE TABLE " + tab + " (scope VARBINARY(255) NOT NULL, k VARBINARY(255) NOT NULL, state TINYINT NOT NULL, v BLOB, expires_at BIGINT NOT NULL, PRIMARY KEY (scope, k), KEY e (expires_at)) ENGINE=InnoDB",
		"CREATE TABLE " + tab + "_o (id BIGINT AUTO_INCREMENT PRIMARY KEY, item VARCHAR(255)) ENGINE=InnoDB",
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			b.Fatal(err)
		}
	}
	defer db.Exec("DROP TABLE " + tab + ", " + tab + "_o")
	drain := func(rows *sql.Rows, err error) error {
		if err != nil {
			return err
		}
		for rows.Next() {
		}
		for rows.NextResultSet() {
			for rows.Next() {
			}
		}
		return rows.Close()
	}
	order := func(c *sql.Conn) error {
		_, err := c.ExecContext(ctx, "INSERT INTO "+tab+"_o (item) VALUES (?)", "x")
		return err
	}
	lockName := func(k string) string {
		return "CONCAT('idem:', LEFT(SHA2(CONCAT(IFNULL(DATABASE(), ''), ':', '" + k + "'), 256), 40))"
	}
	idem := func(lock bool) func(c *sql.Conn, k string) error {
		return func(c *sql.Conn, k string) error {
			take, release := "IF(FOUND_ROWS() > 0, 0, 1)", "1"
			if lock {
				take, release = "IF(FOUND_ROWS() > 0, 0, GET_LOCK("+lockName(k)+", 0) = 1)", "IF(RELEASE_LOCK("+lockName(k)+") = 1, 1, 2)"
			}
			err := drain(c.QueryContext(ctx, "SELECT state, v FROM "+tab+" WHERE scope = 's' AND k = '"+k+"' AND expires_at > 3; SET autocommit = IF("+take+", 0, 2), @@tx_isolation = 'READ-COMMITTED'; SAVEPOINT idem_tx; SELECT expires_at FROM "+tab+" WHERE scope = 's' AND k = '"+k+"'"))
			if err == nil {
				err = order(c)
			}
			if err == nil {
				_, err = c.ExecContext(ctx, "RELEASE SAVEPOINT idem_tx; INSERT INTO "+tab+" VALUES ('s', '"+k+"', 2, 'abc', 5); COMMIT; SET autocommit = "+release)
			}
			return err
		}
	}
	hand := func(lock bool) func(c *sql.Conn, k string) error {
		return func(c *sql.Conn, k string) error {
			pre, post := "", ""
			if lock {
				pre, post = "DO GET_LOCK("+lockName(k)+", 0); ", "; DO RELEASE_LOCK("+lockName(k)+")"
			}
			_, err := c.ExecContext(ctx, pre+"START TRANSACTION; INSERT INTO "+tab+" VALUES ('s', '"+k+"', 1, NULL, 5)")
			if err == nil {
				err = order(c)
			}
			if err == nil {
				_, err = c.ExecContext(ctx, "UPDATE "+tab+" SET state = 2, v = 'abc' WHERE scope = 's' AND k = '"+k+"'; COMMIT"+post)
			}
			return err
		}
	}
	var seq atomic.Int64
	for _, v := range []struct {
		name string
		f    func(c *sql.Conn, k string) error
	}{{"hand", hand(false)}, {"hand+getlock", hand(true)}, {"idem", idem(true)}, {"idem-nolock", idem(false)}} {
		b.Run(v.name, func(b *testing.B) {
			b.SetParallelism(4) // 8 clients on 2 CPUs
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					c, err := db.Conn(ctx)
					if err != nil {
						b.Error(err)
						return
					}
					err = v.f(c, fmt.Sprintf("%s-%d", v.name, seq.Add(1)))
					if err != nil {
						// Close the connection, which ends its transaction, rather
						// than pool it.
						_ = c.Raw(func(any) error { return driver.ErrBadConn })
					}
					_ = c.Close()
					if err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}
