// Package testenv finds the real services tests run against. Each URL comes from
// the environment, defaulting to the service on this machine's loopback. When the
// service cannot be reached the test is skipped with a message that says how to
// provide it — unless IDEM_REQUIRE_SERVICES=1 (CI sets it), when it fails.
package testenv

import (
	"net"
	"net/url"
	"os"
	"testing"
	"time"
)

// Required reports whether IDEM_REQUIRE_SERVICES=1: an unreachable service fails
// the test instead of skipping it.
func Required() bool { return os.Getenv("IDEM_REQUIRE_SERVICES") == "1" }

// service returns the URL in env (or def), after checking that its host accepts
// TCP connections.
func service(t testing.TB, env, def, name string) string {
	t.Helper()
	u := os.Getenv(env)
	if u == "" {
		u = def
	}
	if addr := hostPort(u); addr != "" {
		c, err := net.DialTimeout("tcp", addr, 2*time.Second)
		if err != nil {
			msg := name + " is unreachable at " + addr + " (" + err.Error() + "); start it or set " + env
			if Required() {
				t.Fatal(msg + " (IDEM_REQUIRE_SERVICES=1, so this is a failure)")
			}
			t.Skip(msg)
		}
		_ = c.Close()
	}
	return u
}

func hostPort(raw string) string {
	u, err := url.Parse(raw)
	if err != nil || u.Host == "" {
		return ""
	}
	if u.Port() != "" {
		return u.Host
	}
	switch u.Scheme {
	case "postgres", "postgresql":
		return net.JoinHostPort(u.Hostname(), "5432")
	case "mysql":
		return net.JoinHostPort(u.Hostname(), "3306")
	case "redis":
		return net.JoinHostPort(u.Hostname(), "6379")
	case "nats":
		return net.JoinHostPort(u.Hostname(), "4222")
	case "amqp":
		return net.JoinHostPort(u.Hostname(), "5672")
	}
	return ""
}

// PostgresURL returns IDEM_TEST_POSTGRES_URL, default postgres://postgres@127.0.0.1:5432/test?sslmode=disable.
func PostgresURL(t testing.TB) string {
	return service(t, "IDEM_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable", "PostgreSQL")
}

// MySQLURL returns IDEM_TEST_MYSQL_URL, default mysql://root@127.0.0.1:3306/test.
// Convert it to a go-sql-driver DSN with MySQLDSN.
func MySQLURL(t testing.TB) string {
	return service(t, "IDEM_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test", "MySQL/MariaDB")
}

// MySQLDSN converts a mysql:// URL into a go-sql-driver/mysql DSN with parseTime.
func MySQLDSN(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return raw
	}
	user := u.User.Username()
	if p, ok := u.User.Password(); ok {
		user += ":" + p
	}
	q := u.Query()
	q.Set("parseTime", "true")
	return user + "@tcp(" + u.Host + ")" + u.Path + "?" + q.Encode()
}

// RedisURL returns IDEM_TEST_REDIS_URL, default redis://127.0.0.1:6379/0.
func RedisURL(t testing.TB) string {
	return service(t, "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379/0", "Redis")
}

// NATSURL returns IDEM_TEST_NATS_URL, default nats://127.0.0.1:4222 (a NATS
// server with JetStream enabled: nats-server -js).
func NATSURL(t testing.TB) string {
	return service(t, "IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222", "NATS")
}

// AMQPURL returns IDEM_TEST_AMQP_URL, default amqp://guest:guest@127.0.0.1:5672/
// (RabbitMQ).
func AMQPURL(t testing.TB) string {
	return service(t, "IDEM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/", "RabbitMQ")
}
