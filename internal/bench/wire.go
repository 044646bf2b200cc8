package bench

import (
	"context"
	"encoding/binary"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
)

// protocol is the client side of a database wire protocol, as far as counting
// statements needs it.
type protocol uint8

const (
	protoPostgres protocol = iota // frontend messages: type byte, int32 length
	protoMySQL                    // packets: 3-byte length, sequence number, payload
	protoRedis                    // RESP: arrays of bulk strings
)

// wireCounter counts, over every connection dialled through it, the round trips
// (a write that follows a read on the same connection: the client waited for an
// answer before sending again) and the statements the client sent (PostgreSQL:
// Query and Execute messages; MySQL: COM_QUERY and COM_STMT_EXECUTE; Redis: one
// per command).
type wireCounter struct {
	proto      protocol
	roundTrips atomic.Int64
	statements atomic.Int64
}

// dial dials like net.Dialer and wraps the connection so that it is counted.
func (w *wireCounter) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	cc := &countingConn{Conn: c, w: w, startup: w.proto == protoPostgres}
	cc.readSince.Store(true) // the first write starts a round trip
	return cc, nil
}

// countingConn is a net.Conn that feeds what it writes to its wireCounter.
type countingConn struct {
	net.Conn
	w *wireCounter

	readSince atomic.Bool // something was read since the last write

	mu      sync.Mutex
	startup bool   // PostgreSQL: the next message is the untyped startup message
	skip    int    // payload bytes still to pass over
	hdr     []byte // a header (Redis: a line) being collected
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.readSince.Store(true)
	}
	return n, err
}

func (c *countingConn) Write(p []byte) (int, error) {
	if c.readSince.Swap(false) {
		c.w.roundTrips.Add(1)
	}
	c.mu.Lock()
	c.feed(p)
	c.mu.Unlock()
	return c.Conn.Write(p)
}

// feed parses the client's byte stream just enough to count statements.
func (c *countingConn) feed(p []byte) {
	for len(p) > 0 {
		if c.skip > 0 {
			n := min(c.skip, len(p))
			c.skip -= n
			p = p[n:]
			continue
		}
		switch c.w.proto {
		case protoPostgres:
			need := 5
			if c.startup {
				need = 4
			}
			p = c.collect(p, need)
			if len(c.hdr) < need {
				return
			}
			if c.startup {
				c.startup = false
				c.skip = int(binary.BigEndian.Uint32(c.hdr)) - 4
			} else {
				if t := c.hdr[0]; t == 'Q' || t == 'E' {
					c.w.statements.Add(1)
				}
				c.skip = int(binary.BigEndian.Uint32(c.hdr[1:])) - 4
			}
			c.hdr = c.hdr[:0]
		case protoMySQL:
			p = c.collect(p, 5)
			if len(c.hdr) < 5 {
				return
			}
			size := int(c.hdr[0]) | int(c.hdr[1])<<8 | int(c.hdr[2])<<16
			if seq, cmd := c.hdr[3], c.hdr[4]; seq == 0 && (cmd == 0x03 || cmd == 0x17) {
				c.w.statements.Add(1) // COM_QUERY, COM_STMT_EXECUTE
			}
			c.skip = size - 1
			c.hdr = c.hdr[:0]
		case protoRedis:
			// A line: "*N" starts a command of N bulk strings, "$L" a bulk string of L bytes.
			i := 0
			for i < len(p) && p[i] != '\n' {
				i++
			}
			if i == len(p) {
				c.hdr = append(c.hdr, p...)
				return
			}
			c.hdr = append(c.hdr, p[:i+1]...)
			p = p[i+1:]
			line := c.hdr
			if len(line) >= 3 {
				n, _ := strconv.Atoi(string(line[1 : len(line)-2]))
				switch line[0] {
				case '*':
					c.w.statements.Add(1)
				case '$':
					c.skip = n + 2
				}
			}
			c.hdr = c.hdr[:0]
		}
	}
}

// collect moves bytes from p into c.hdr until it holds need bytes, and returns
// the rest of p.
func (c *countingConn) collect(p []byte, need int) []byte {
	n := min(need-len(c.hdr), len(p))
	c.hdr = append(c.hdr, p[:n]...)
	return p[n:]
}
