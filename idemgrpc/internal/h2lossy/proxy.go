// Package h2lossy is a TCP proxy for HTTP/2 (gRPC) that loses answers: the
// request reaches the server, the server carries it out and begins to answer,
// and the client's connection is reset before the answer reaches it.
//
// client/clienttest.Proxy cannot do this for HTTP/2: it takes the first byte the
// server sends for the start of the answer, and an HTTP/2 server sends its
// SETTINGS frame before any request. This proxy reads the server's frames and
// takes the first HEADERS frame of a stream for the start of that call's answer.
package h2lossy

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Proxy forwards loopback connections to a target. Each call's answer (the
// first HEADERS frame the server sends on a stream) is lost with probability
// DropRate, but never more than MaxConsecutive answers in a row: the proxy then
// resets the client's connection (TCP RST) and closes the server's, which loses
// every other answer still due on that connection too.
type Proxy struct {
	target         string
	dropRate       float64
	maxConsecutive int
	ln             net.Listener

	mu     sync.Mutex
	rng    *rand.Rand
	run    int // answers dropped in a row
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup

	answers, dropped atomic.Int64
}

// New starts a proxy on a free loopback port in front of target ("host:port").
func New(target string, dropRate float64, maxConsecutive int, seed uint64) (*Proxy, error) {
	if dropRate < 0 || dropRate > 1 {
		return nil, fmt.Errorf("h2lossy: dropRate %v is not a fraction from 0 to 1", dropRate)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("h2lossy: listen on loopback: %w", err)
	}
	p := &Proxy{
		target: target, dropRate: dropRate, maxConsecutive: maxConsecutive, ln: ln,
		rng:   rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		conns: make(map[net.Conn]struct{}),
	}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// Addr returns the proxy's "host:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Answers returns how many calls the server began to answer.
func (p *Proxy) Answers() int64 { return p.answers.Load() }

// Dropped returns how many answers were lost by a reset (the first on each reset
// connection; others due on it are lost with it).
func (p *Proxy) Dropped() int64 { return p.dropped.Load() }

// Close stops the proxy, closes its connections and waits for its goroutines.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	for c := range p.conns {
		_ = c.Close()
	}
	p.mu.Unlock()
	err := p.ln.Close()
	p.wg.Wait()
	return err
}

func (p *Proxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		if !p.track(c) {
			_ = c.Close()
			return
		}
		p.wg.Add(1)
		go p.handle(c)
	}
}

func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	for _, c := range cs {
		p.conns[c] = struct{}{}
	}
	return true
}

func (p *Proxy) forget(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
	}
}

// drop decides whether the answer that begins now is lost.
func (p *Proxy) drop() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.run >= p.maxConsecutive || p.rng.Float64() >= p.dropRate {
		p.run = 0
		return false
	}
	p.run++
	return true
}

func (p *Proxy) handle(client net.Conn) {
	defer p.wg.Done()
	up, err := net.DialTimeout("tcp", p.target, 10*time.Second)
	if err != nil || !p.track(up) {
		if up != nil {
			_ = up.Close()
		}
		reset(client)
		p.forget(client)
		return
	}
	defer p.forget(client, up)
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		_, _ = io.Copy(up, client)
		_ = up.Close()
	}()

	const (
		frameHeaders = 0x1
		headerLen    = 9
	)
	br := bufio.NewReader(up)
	var hdr [headerLen]byte
	var payload []byte
	answered := make(map[uint32]bool)
	for {
		if _, err := io.ReadFull(br, hdr[:]); err != nil {
			break
		}
		n := int(hdr[0])<<16 | int(hdr[1])<<8 | int(hdr[2])
		if cap(payload) < n {
			payload = make([]byte, n)
		}
		payload = payload[:n]
		if _, err := io.ReadFull(br, payload); err != nil {
			break
		}
		stream := binary.BigEndian.Uint32(hdr[5:]) & 0x7fffffff
		if hdr[3] == frameHeaders && stream != 0 && !answered[stream] {
			answered[stream] = true
			p.answers.Add(1)
			if p.drop() {
				p.dropped.Add(1)
				reset(client)
				_ = up.Close()
				return
			}
		}
		if _, err := client.Write(hdr[:]); err != nil {
			break
		}
		if _, err := client.Write(payload); err != nil {
			break
		}
	}
	_ = client.Close()
	_ = up.Close()
}

// reset closes c with a TCP RST.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}
