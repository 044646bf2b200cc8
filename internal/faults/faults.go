// Package faults injects network faults into tests: Proxy forwards TCP
// connections to a server and cuts them on demand, in the middle of whatever
// call is on the wire, the way a crashed host, a firewall timeout or a failover
// would.
//
// A test points its client (a database pool, a Redis client) at Proxy.Addr
// instead of the server, and calls Cut — directly, or every few milliseconds
// through CutEvery — while its workload runs. A call whose connection is cut
// fails with a network error, and whether it took effect on the server is
// unknown: that is the point.
package faults

import (
	"errors"
	"net"
	"sync"
	"time"
)

// Proxy forwards every connection accepted on a loopback port to a target
// address. Its zero value is not usable; call Listen.
type Proxy struct {
	ln     net.Listener
	target string

	mu     sync.Mutex
	conns  map[net.Conn]time.Time // when each end was accepted or dialled
	peers  map[net.Conn]net.Conn  // the other end of each forwarded connection
	cuts   int
	closed bool
	hold   chan struct{} // non-nil while held: closed by Release
	wg     sync.WaitGroup
}

// Listen starts a proxy on 127.0.0.1 (a free port) that forwards to target
// ("host:port"). Call Close to stop it.
func Listen(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[net.Conn]time.Time{}, peers: map[net.Conn]net.Conn{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's "host:port": give it to the client instead of the target.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			_ = client.Close()
			continue
		}
		if !p.track(client, server) {
			_ = client.Close()
			_ = server.Close()
			return
		}
		p.wg.Add(2)
		go p.pipe(client, server)
		go p.pipe(server, client)
	}
}

// track registers both ends of a forwarded connection; false once closed.
func (p *Proxy) track(client, server net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	now := time.Now()
	p.conns[client], p.conns[server] = now, now
	p.peers[client], p.peers[server] = server, client
	return true
}

// pipe copies from src to dst; when either side fails, both are closed.
// While the proxy is held (Hold), what it reads waits, undelivered, until
// Release.
func (p *Proxy) pipe(dst, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if gate := p.gate(); gate != nil {
				<-gate
			}
			if _, werr := dst.Write(buf[:n]); werr != nil {
				break
			}
		}
		if err != nil {
			break
		}
	}
	_ = dst.Close()
	_ = src.Close()
	p.mu.Lock()
	delete(p.conns, dst)
	delete(p.conns, src)
	delete(p.peers, dst)
	delete(p.peers, src)
	p.mu.Unlock()
}

// Cut closes every open connection through the proxy at once, abruptly (with
// a TCP reset where the system allows it), and returns how many connection
// ends it closed. New connections are still accepted: a pool reconnects.
func (p *Proxy) Cut() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for c := range p.conns {
		if tc, ok := c.(*net.TCPConn); ok {
			_ = tc.SetLinger(0) // RST, not FIN: the peer sees the connection die
		}
		_ = c.Close()
		delete(p.conns, c)
		delete(p.peers, c)
		n++
	}
	p.cuts++
	return n
}

// CutOne closes one open connection (both of its ends), chosen at random, and
// reports whether there was one to close: a fault that hits one call among
// many, while the others go on.
func (p *Proxy) CutOne() bool { return p.CutOneOlderThan(0) }

// CutOneOlderThan is CutOne among the connections made at least age ago, so
// that a client whose connections take longer to set up than the interval
// between cuts is not cut off from the server altogether (on a slow machine,
// cutting connections still in their handshake every few milliseconds left
// almost no call with a known outcome).
func (p *Proxy) CutOneOlderThan(age time.Duration) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	cutoff := time.Now().Add(-age)
	for c, made := range p.conns { // map order is random
		if made.After(cutoff) {
			continue
		}
		peer := p.peers[c]
		for _, e := range []net.Conn{c, peer} {
			if e == nil {
				continue
			}
			if tc, ok := e.(*net.TCPConn); ok {
				_ = tc.SetLinger(0)
			}
			_ = e.Close()
			delete(p.conns, e)
			delete(p.peers, e)
		}
		p.cuts++
		return true
	}
	return false
}

// cutOlderThan closes every connection made at least age ago, both of its
// ends, and counts one cut if it closed any.
func (p *Proxy) cutOlderThan(age time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	cutoff := time.Now().Add(-age)
	n := 0
	for c, made := range p.conns {
		if made.After(cutoff) {
			continue
		}
		for _, e := range []net.Conn{c, p.peers[c]} {
			if e == nil {
				continue
			}
			if tc, ok := e.(*net.TCPConn); ok {
				_ = tc.SetLinger(0)
			}
			_ = e.Close()
			delete(p.conns, e)
			delete(p.peers, e)
		}
		n++
	}
	if n > 0 {
		p.cuts++
	}
}

// Cuts reports how many times Cut or CutOne cut something (Cut counts once
// per call).
func (p *Proxy) Cuts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.cuts
}

// CutEvery calls Cut every interval until stop is called.
func (p *Proxy) CutEvery(interval time.Duration) (stop func()) {
	return p.CutEveryOlderThan(interval, 0)
}

// CutEveryOlderThan closes, every interval until stop is called, every
// connection made at least age ago (both of its ends). A client whose
// connections take longer to set up and use than interval (a database pool on
// a loaded machine: connect, authenticate, then the statements) is still cut
// mid-call, but not cut off from the server altogether.
func (p *Proxy) CutEveryOlderThan(interval, age time.Duration) (stop func()) {
	done := make(chan struct{})
	var once sync.Once
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				if age <= 0 {
					p.Cut()
				} else {
					p.cutOlderThan(age)
				}
			}
		}
	}()
	return func() {
		once.Do(func() { close(done) })
		wg.Wait()
	}
}

// gate returns the channel a forwarding goroutine waits on while the proxy is
// held, nil otherwise.
func (p *Proxy) gate() chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.hold
}

// Hold black-holes the proxy: connections stay open (old ones and new ones,
// which are still accepted), but nothing is forwarded either way until
// Release, so a client sees its calls hang rather than fail — the way a
// partitioned network or a hung broker looks, until the client's own timeout
// or heartbeat gives up. What was sent meanwhile is delivered on Release, as
// TCP would retransmit it; Cut while held drops it with the connection.
func (p *Proxy) Hold() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.hold == nil {
		p.hold = make(chan struct{})
	}
}

// Release ends a Hold: forwarding resumes on the connections still open.
func (p *Proxy) Release() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.hold != nil {
		close(p.hold)
		p.hold = nil
	}
}

// Close stops accepting, cuts every open connection and waits for the
// forwarding goroutines to end.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.Release()
	err := p.ln.Close()
	p.Cut()
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}
