package prooftest

import (
	"io"
	"net"
	"net/url"
	"sync"
	"testing"
)

// Outage is a TCP proxy on loopback in front of a database that can be taken
// down and brought back: while it is down every open connection is cut and
// every new one is closed as soon as it is accepted, as during a failover or
// a network partition. The database itself keeps running, so the test sees
// what its clients see during an outage: every call fails, with an unknown
// outcome for the ones on the wire at the cut.
type Outage struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	down   bool
	conns  map[net.Conn]struct{}
	wg     sync.WaitGroup
}

// NewOutage starts a proxy to target ("host:port"), up; it closes with t.
func NewOutage(t testing.TB, target string) *Outage {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &Outage{ln: ln, target: target, conns: map[net.Conn]struct{}{}}
	o.wg.Add(1)
	go o.accept()
	t.Cleanup(func() {
		_ = ln.Close()
		o.SetDown(true)
		o.wg.Wait()
	})
	return o
}

// Addr is the proxy's "host:port".
func (o *Outage) Addr() string { return o.ln.Addr().String() }

// URL returns raw (a database URL) with its host:port replaced by the proxy's.
func (o *Outage) URL(t testing.TB, raw string) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	u.Host = o.Addr()
	return u.String()
}

// SetDown takes the proxy down (cutting every connection) or brings it up.
func (o *Outage) SetDown(down bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.down = down
	if down {
		for c := range o.conns {
			_ = c.Close()
		}
	}
}

func (o *Outage) accept() {
	defer o.wg.Done()
	for {
		c, err := o.ln.Accept()
		if err != nil {
			return
		}
		o.mu.Lock()
		down := o.down
		o.mu.Unlock()
		if down {
			_ = c.Close()
			continue
		}
		s, err := net.Dial("tcp", o.target)
		if err != nil {
			_ = c.Close()
			continue
		}
		o.mu.Lock()
		if o.down {
			o.mu.Unlock()
			_ = c.Close()
			_ = s.Close()
			continue
		}
		o.conns[c], o.conns[s] = struct{}{}, struct{}{}
		o.mu.Unlock()
		o.wg.Add(2)
		go o.pipe(c, s)
		go o.pipe(s, c)
	}
}

func (o *Outage) pipe(dst, src net.Conn) {
	defer o.wg.Done()
	_, _ = io.Copy(dst, src)
	_ = dst.Close()
	_ = src.Close()
	o.mu.Lock()
	delete(o.conns, dst)
	delete(o.conns, src)
	o.mu.Unlock()
}

// HostPort returns the "host:port" of a database URL.
func HostPort(t testing.TB, raw string) string {
	t.Helper()
	u, err := url.Parse(raw)
	if err != nil {
		t.Fatal(err)
	}
	if u.Port() == "" {
		return u.Hostname() + ":5432"
	}
	return u.Host
}
