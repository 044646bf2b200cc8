module github.com/idemkit/idem/internal/checker

go 1.26.0

replace github.com/idemkit/idem => ../..

replace github.com/idemkit/idem/sqlitestore => ../../sqlitestore

replace github.com/idemkit/idem/client => ../../client

require (
	github.com/idemkit/idem v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/client v0.0.0-00010101000000-000000000000
)

require github.com/google/uuid v1.6.0 // indirect
