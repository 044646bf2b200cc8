module github.com/idemkit/idem/cmd/idem

go 1.26.0

require (
	github.com/go-chi/httprate v0.16.1
	github.com/go-sql-driver/mysql v1.10.1
	github.com/idemkit/idem v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/consumer v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/consumer/amqp v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/idemprom v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/internal/bench v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/internal/checker v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/internal/dbopen v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/internal/orders v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/mysqlstore v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/outbox/amqp v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/outbox/natsjs v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/pgstore v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/proxy v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/redisstore v0.0.0-00010101000000-000000000000
	github.com/idemkit/idem/sqlitestore v0.0.0-00010101000000-000000000000
	github.com/jackc/pgx/v5 v5.12.0
	github.com/nats-io/nats.go v1.55.0
	github.com/prometheus/client_golang v1.25.0
	github.com/prometheus/common v0.73.1
	github.com/rabbitmq/amqp091-go v1.16.0
	github.com/redis/go-redis/v9 v9.23.0
)

require (
	filippo.io/edwards25519 v1.2.0 // indirect
	github.com/andybalholm/brotli v1.1.0 // indirect
	github.com/beorn7/perks v1.0.1 // indirect
	github.com/cespare/xxhash/v2 v2.3.0 // indirect
	github.com/dustin/go-humanize v1.1.0 // indirect
	github.com/go-jose/go-jose/v4 v4.1.9 // indirect
	github.com/gofiber/fiber/v2 v2.52.15 // indirect
	github.com/google/uuid v1.6.0 // indirect
	github.com/idemkit/idem/client v0.0.0-00010101000000-000000000000 // indirect
	github.com/jackc/pgpassfile v1.0.0 // indirect
	github.com/jackc/pgservicefile v0.0.0-20240606120523-5a60cdf6a761 // indirect
	github.com/jackc/puddle/v2 v2.2.3 // indirect
	github.com/klauspost/compress v1.20.1 // indirect
	github.com/klauspost/cpuid/v2 v2.4.0 // indirect
	github.com/mattn/go-colorable v0.1.13 // indirect
	github.com/mattn/go-isatty v0.0.24 // indirect
	github.com/mattn/go-runewidth v0.0.16 // indirect
	github.com/munnerz/goautoneg v0.0.0-20191010083416-a7dc8b61c822 // indirect
	github.com/nats-io/nkeys v0.4.16 // indirect
	github.com/nats-io/nuid v1.0.1 // indirect
	github.com/ncruces/go-strftime v1.1.0 // indirect
	github.com/pandatix/go-abnf v0.5.3 // indirect
	github.com/philhofer/fwd v1.1.3-0.20240916144458-20a13a1f6b7c // indirect
	github.com/prometheus/client_model v0.6.3 // indirect
	github.com/prometheus/procfs v0.22.0 // indirect
	github.com/remyoudompheng/bigfft v0.0.0-20230129092748-24d4a6f8daec // indirect
	github.com/rivo/uniseg v0.2.0 // indirect
	github.com/tinylib/msgp v1.2.5 // indirect
	github.com/valyala/bytebufferpool v1.0.0 // indirect
	github.com/valyala/fasthttp v1.51.0 // indirect
	github.com/valyala/tcplisten v1.0.0 // indirect
	github.com/zeebo/xxh3 v1.1.0 // indirect
	go.uber.org/atomic v1.12.0 // indirect
	go.yaml.in/yaml/v3 v3.0.6 // indirect
	golang.org/x/crypto v0.57.0 // indirect
	golang.org/x/sync v0.24.0 // indirect
	golang.org/x/sys v0.49.0 // indirect
	golang.org/x/text v0.43.0 // indirect
	google.golang.org/protobuf v1.36.12 // indirect
	modernc.org/libc v1.80.1 // indirect
	modernc.org/mathutil v1.7.1 // indirect
	modernc.org/memory v1.12.1 // indirect
	modernc.org/sqlite v1.62.0 // indirect
)

replace github.com/idemkit/idem => ../..

replace github.com/idemkit/idem/storetest => ../../storetest

replace github.com/idemkit/idem/pgstore => ../../pgstore

replace github.com/idemkit/idem/mysqlstore => ../../mysqlstore

replace github.com/idemkit/idem/sqlitestore => ../../sqlitestore

replace github.com/idemkit/idem/redisstore => ../../redisstore

replace github.com/idemkit/idem/client => ../../client

replace github.com/idemkit/idem/idemprom => ../../idemprom

replace github.com/idemkit/idem/proxy => ../../proxy

replace github.com/idemkit/idem/internal/bench => ../../internal/bench

replace github.com/idemkit/idem/internal/dbopen => ../../internal/dbopen

replace github.com/idemkit/idem/internal/orders => ../../internal/orders

replace github.com/idemkit/idem/internal/checker => ../../internal/checker

replace github.com/idemkit/idem/idemgrpc => ../../idemgrpc

replace github.com/idemkit/idem/outbox/natsjs => ../../outbox/natsjs

replace github.com/idemkit/idem/outbox/amqp => ../../outbox/amqp

replace github.com/idemkit/idem/consumer => ../../consumer

replace github.com/idemkit/idem/consumer/internal/prooftest => ../../consumer/internal/prooftest

replace github.com/idemkit/idem/consumer/amqp => ../../consumer/amqp
