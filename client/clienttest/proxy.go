package clienttest

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// Stats counts what a Proxy did.
type Stats struct {
	// Connections is how many client connections the proxy accepted.
	Connections int64
	// Answered is how many of them the server began to answer on: the first byte
	// of a final answer, after any interim (1xx) ones.
	Answered int64
	// Dropped is how many answers were lost: the server began answering on a lossy
	// connection, and the proxy reset the client's connection instead of passing
	// the answer on. Each is one request the server carried out whose client never
	// heard the outcome.
	Dropped int64
}

// Proxy is a TCP proxy on 127.0.0.1. Each connection it accepts is lossy with
// probability DropRate: the proxy forwards what the client sends, waits for the
// first byte of the server's final answer — proof that the server handled the
// request (an idem server answers only after committing); interim 1xx answers
// such as 100 Continue are passed on and do not count — and then resets the client's
// connection (TCP RST) and closes the server's. Other connections are passed
// through unchanged. A lossy keep-alive connection loses its first answer and dies
// with it.
type Proxy struct {
	target   string
	dropRate float64
	seed     uint64
	ln       net.Listener

	mu     sync.Mutex
	rng    *rand.Rand
	conns  map[net.Conn]struct{}
	closed bool
	wg     sync.WaitGroup

	connections, answered, dropped atomic.Int64
}

// NewProxy starts a proxy on a free loopback port that forwards to target
// ("host:port"), losing the answers of a dropRate fraction of connections (0 to 1),
// chosen at random from seed (0 picks a random seed; see Seed). Close it when done.
func NewProxy(target string, dropRate float64, seed uint64) (*Proxy, error) {
	if dropRate < 0 || dropRate > 1 {
		return nil, fmt.Errorf("clienttest: dropRate %v is not a fraction; use a value from 0 to 1", dropRate)
	}
	if seed == 0 {
		seed = rand.Uint64() | 1
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("clienttest: listen on loopback: %w", err)
	}
	p := &Proxy{
		target: target, dropRate: dropRate, seed: seed, ln: ln,
		rng:   rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15)),
		conns: make(map[net.Conn]struct{}),
	}
	p.wg.Add(1)
	go p.serve()
	return p, nil
}

// Addr returns the proxy's "host:port".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// URL returns "http://" + Addr().
func (p *Proxy) URL() string { return "http://" + p.Addr() }

// Seed returns the seed of the random choice of lossy connections; pass it to
// NewProxy to repeat a run.
func (p *Proxy) Seed() uint64 { return p.seed }

// Stats returns the counts so far.
func (p *Proxy) Stats() Stats {
	return Stats{Connections: p.connections.Load(), Answered: p.answered.Load(), Dropped: p.dropped.Load()}
}

// Close stops accepting, closes every open connection and waits for every
// goroutine of the proxy to end.
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
		p.connections.Add(1)
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = c.Close()
			return
		}
		lossy := p.rng.Float64() < p.dropRate
		p.conns[c] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go p.handle(c, lossy)
	}
}

// track registers c for Close; it reports false when the proxy is closing.
func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[c] = struct{}{}
	return true
}

func (p *Proxy) forget(cs ...net.Conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range cs {
		delete(p.conns, c)
	}
}

func (p *Proxy) handle(client net.Conn, lossy bool) {
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
		if tc, ok := up.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
	}()

	// Interim (1xx) answers are not the answer: the server sends 100 Continue or
	// 103 Early Hints before it has done the work. They are passed on, and the
	// final answer is the one that counts and, on a lossy connection, is lost.
	br := bufio.NewReader(up)
	answered := passInterim(br, client)
	if answered {
		p.answered.Add(1)
	}
	if lossy {
		if answered {
			p.dropped.Add(1)
		}
		reset(client)
		_ = up.Close()
		return
	}
	_, _ = io.Copy(client, br)
	_ = client.Close()
	_ = up.Close()
}

// passInterim copies the interim (1xx, but not 101 Switching Protocols) answers
// at the start of br to w, and reports whether a final answer follows: whether
// br has another byte.
func passInterim(br *bufio.Reader, w io.Writer) bool {
	for {
		b, err := br.Peek(len("HTTP/1.1 100"))
		if err != nil {
			// Too short for a status line: a final answer if it has a byte at all.
			_, err := br.Peek(1)
			return err == nil
		}
		code := string(b[len(b)-3:])
		if !bytes.HasPrefix(b, []byte("HTTP/1.")) || code[0] != '1' || code == "101" {
			return true
		}
		// An interim answer: its status line and header lines, up to an empty line.
		for {
			line, err := br.ReadSlice('\n')
			if len(line) > 0 {
				if _, werr := w.Write(line); werr != nil {
					err = werr
				}
			}
			if err != nil {
				return false
			}
			if len(bytes.TrimRight(line, "\r\n")) == 0 {
				break
			}
		}
	}
}

// reset closes c with a TCP RST instead of an orderly FIN.
func reset(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}
