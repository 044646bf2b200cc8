module github.com/idemkit/idem/outbox/natsjs

go 1.26.0

require (
	github.com/go-sql-driver/mysql v1.10.1
	github.com/idemkit/idem v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/mysqlstore v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/pgstore v0.0.0-00010101000000-000000000000
	github.com/jackc/pgx/v5 v5.12.0
	github.com/nats-io/nats.go v1.55.0
)

require (
	filippo.io/edwards25519 v1.2.0 // indirect
	github.com/jackc/pgpassfile v1.0.0 // indirect
	github.com/jackc/pgservicefile v0.0.0-20240606120523-5a60cdf6a761 // indirect
	github.com/jackc/puddle/v2 v2.2.3 // indirect
	github.com/klauspost/compress v1.20.0 // indirect
	github.com/nats-io/nkeys v0.4.16 // indirect
	github.com/nats-io/nuid v1.0.1 // indirect
	golang.org/x/crypto v0.57.0 // indirect
	golang.org/x/sync v0.23.0 // indirect
	golang.org/x/sys v0.48.0 // indirect
	golang.org/x/text v0.42.0 // indirect
)

replace github.com/idemkit/idem => ../..

replace github.com/idemkit/idem/pgstore => ../../pgstore

replace github.com/idemkit/idem/storetest => ../../storetest

replace github.com/idemkit/idem/mysqlstore => ../../mysqlstore
