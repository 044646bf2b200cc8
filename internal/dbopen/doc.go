// Package dbopen turns the CLI's --db and --keys flags into an opened business
// database and an idem store, for `idem demo`, `idem migrate`, `idem gc` and
// `idem inspect`. Every command names a database in the same URL forms: `idem
// bench --postgres/--mysql/--redis` are checked with ParseDBFlag and
// ParseRedis, whose errors name the flag and say what to write instead. A
// go-sql-driver DSN (root@tcp(127.0.0.1:3306)/test, the form the Go examples
// and database/sql programs use) is accepted wherever a mysql:// URL is.
//
// # --db
//
//	sqlite:PATH, sqlite://PATH          embedded SQLite file (modernc.org/sqlite, WAL),
//	                                    created if missing; sqlite:///abs/path for an
//	                                    absolute path. Default: sqlite:idem-demo.db
//	postgres://… or postgresql://…     PostgreSQL through pgx (any pgx URL; the pool
//	                                    gets 16 connections unless pool_max_conns says)
//	mysql://USER[:PASS]@HOST[:PORT]/DB  MySQL or MariaDB through go-sql-driver/mysql,
//	                                    with parseTime=true; other query parameters are
//	                                    driver options (tls=true, timeout=5s, …)
//	USER[:PASS]@tcp(HOST:PORT)/DB       the same database in go-sql-driver/mysql's DSN
//	                                    form (also after mysql://); parseTime=true too
//
// # --keys
//
// Empty (the default) keeps the key records in the --db database, with the SQL
// store of that dialect (sqlitestore, pgstore, mysqlstore): the store is an
// idem.TxStore, and an order and its stored answer commit in one transaction.
// redis://HOST:PORT/N (or rediss:// for TLS) keeps them in Redis (redisstore):
// the claim is still atomic and fenced, but the order commits in a transaction of
// its own, so a crash between that commit and the completion in Redis can let a
// retry create a second order.
//
// # Schema
//
// Open creates no table; it creates a missing SQLite file unless
// Options.MustExist (for commands that only read or clean up). Handle.Migrate
// creates the PostgreSQL schema of Options.Schema if missing and creates or
// upgrades the key records' table (default idem_records; see each store's
// package documentation), and orders.Service.Migrate the orders table
// (Handle.OrdersTable). Options.Prefix and Options.Schema name both tables as
// `idem demo --prefix/--schema` do: [SCHEMA.]PREFIXidem_records and
// [SCHEMA.]PREFIXorders.
package dbopen
