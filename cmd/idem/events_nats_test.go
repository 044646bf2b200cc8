package main

import (
	"errors"
	"io"
	"log/slog"
	"net"
	"net/url"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/internal/faults"
	"github.com/idemkit/idem/internal/testenv"
)

// TestConnectNATSBuffersNothing: the connection the demo's and `idem
// relay`'s publisher use must not buffer publications while it is down
// (what natsjs.NewPublisher asks of its caller): a publication that timed
// out during an outage would otherwise still be sent from the buffer once
// the server is back, a late duplicate possibly after the stream's duplicate
// window. While reconnecting, a publish must fail at once.
func TestConnectNATSBuffersNothing(t *testing.T) {
	u, _ := url.Parse(testenv.NATSURL(t))
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "4222")
	}
	fp, err := faults.Listen(host)
	if err != nil {
		t.Fatal(err)
	}
	defer fp.Close()
	nc, _, err := connectNATS("nats://"+fp.Addr(), "test", slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	deadline := time.Now().Add(10 * time.Second)
	for !nc.IsConnected() {
		if time.Now().After(deadline) {
			t.Fatal("not connected after 10 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	fp.Hold() // new connections hang, so the client stays disconnected
	defer fp.Release()
	fp.Cut()
	for nc.IsConnected() {
		if time.Now().After(deadline) {
			t.Fatal("still connected after the cut")
		}
		time.Sleep(5 * time.Millisecond)
	}
	err = nc.Publish("idem.test.buffered", []byte("late"))
	if !errors.Is(err, nats.ErrReconnectBufExceeded) {
		t.Fatalf("publish while disconnected: %v; want %v (nothing buffered)", err, nats.ErrReconnectBufExceeded)
	}
}
