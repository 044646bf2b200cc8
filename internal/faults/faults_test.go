package faults

import (
	"bufio"
	"io"
	"net"
	"sync"
	"testing"
	"time"
)

// echoServer answers every line with the same line, on a loopback port.
func echoServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { _ = ln.Close(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				_, _ = io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().String()
}

func roundTrip(c net.Conn, r *bufio.Reader, msg string) (string, error) {
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte(msg + "\n")); err != nil {
		return "", err
	}
	return r.ReadString('\n')
}

func dial(t *testing.T, p *Proxy) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c, bufio.NewReader(c)
}

// A cut connection fails at once, in the middle of a call; new connections
// still go through.
func TestCutBreaksOpenConnections(t *testing.T) {
	t.Parallel()
	p, err := Listen(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	const n = 8
	conns := make([]net.Conn, n)
	readers := make([]*bufio.Reader, n)
	for i := range n {
		conns[i], readers[i] = dial(t, p)
		if got, err := roundTrip(conns[i], readers[i], "hello"); err != nil || got != "hello\n" {
			t.Fatalf("through the proxy: %q, %v", got, err)
		}
	}
	if cut := p.Cut(); cut != 2*n {
		t.Errorf("Cut closed %d connection ends, want %d", cut, 2*n)
	}
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, errs[i] = roundTrip(conns[i], readers[i], "again")
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err == nil {
			t.Errorf("connection %d still works after Cut", i)
		}
	}
	c, r := dial(t, p)
	if got, err := roundTrip(c, r, "fresh"); err != nil || got != "fresh\n" {
		t.Fatalf("a new connection after Cut: %q, %v", got, err)
	}
}

// CutOne breaks one connection and leaves the others working.
func TestCutOne(t *testing.T) {
	t.Parallel()
	p, err := Listen(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	a, ra := dial(t, p)
	b, rb := dial(t, p)
	for _, x := range []struct {
		c net.Conn
		r *bufio.Reader
	}{{a, ra}, {b, rb}} {
		if _, err := roundTrip(x.c, x.r, "up"); err != nil {
			t.Fatal(err)
		}
	}
	if !p.CutOne() {
		t.Fatal("CutOne found nothing to cut")
	}
	_, errA := roundTrip(a, ra, "x")
	_, errB := roundTrip(b, rb, "x")
	if (errA == nil) == (errB == nil) {
		t.Fatalf("after CutOne: errors %v and %v, want exactly one connection broken", errA, errB)
	}
	if p.Cuts() != 1 {
		t.Errorf("Cuts = %d, want 1", p.Cuts())
	}
}

// CutEvery keeps cutting while calls run, and stops when told.
func TestCutEvery(t *testing.T) {
	t.Parallel()
	p, err := Listen(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	stop := p.CutEvery(5 * time.Millisecond)
	failed := 0
	for range 50 {
		c, err := net.Dial("tcp", p.Addr())
		if err != nil {
			failed++ // cut while it was being set up
			continue
		}
		r := bufio.NewReader(c)
		for range 20 {
			if _, err := roundTrip(c, r, "ping"); err != nil {
				failed++
				break
			}
			time.Sleep(time.Millisecond)
		}
		_ = c.Close()
	}
	stop()
	if failed == 0 {
		t.Error("no connection was cut while CutEvery ran")
	}
	c, r := dial(t, p)
	time.Sleep(20 * time.Millisecond)
	if _, err := roundTrip(c, r, "quiet"); err != nil {
		t.Errorf("a connection was cut after stop: %v", err)
	}
}

// Hold stops forwarding without closing anything: a call hangs until Release,
// then completes; Cut during a hold still breaks the connection.
func TestHoldRelease(t *testing.T) {
	t.Parallel()
	p, err := Listen(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	c, r := dial(t, p)
	if _, err := roundTrip(c, r, "up"); err != nil {
		t.Fatal(err)
	}
	p.Hold()
	_ = c.SetDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := c.Write([]byte("held\n")); err != nil {
		t.Fatal(err)
	}
	if got, err := r.ReadString('\n'); err == nil {
		t.Fatalf("an answer came through a held proxy: %q", got)
	}
	fresh, err := net.DialTimeout("tcp", p.Addr(), time.Second)
	if err != nil {
		t.Fatalf("a held proxy refused a new connection: %v", err)
	}
	fr := bufio.NewReader(fresh)
	_ = fresh.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := fresh.Write([]byte("queued\n")); err != nil {
		t.Fatal(err)
	}
	p.Release()
	if got, err := fr.ReadString('\n'); err != nil || got != "queued\n" {
		t.Fatalf("after Release, the held call got %q, %v", got, err)
	}
	_ = fresh.Close()
	c2, r2 := dial(t, p)
	if _, err := roundTrip(c2, r2, "up"); err != nil {
		t.Fatal(err)
	}
	p.Hold()
	p.Cut()
	p.Release()
	if _, err := roundTrip(c2, r2, "x"); err == nil {
		t.Fatal("a connection cut while held still works")
	}
}

// CutEveryOlderThan spares a connection younger than the age and cuts it once
// it is older.
func TestCutEveryOlderThan(t *testing.T) {
	t.Parallel()
	p, err := Listen(echoServer(t))
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	stop := p.CutEveryOlderThan(5*time.Millisecond, time.Hour)
	c, r := dial(t, p)
	time.Sleep(30 * time.Millisecond) // six ticks
	if _, err := roundTrip(c, r, "young"); err != nil {
		t.Fatalf("a connection younger than the age was cut: %v", err)
	}
	stop()
	if p.Cuts() != 0 {
		t.Fatalf("Cuts = %d, want 0", p.Cuts())
	}
	stop = p.CutEveryOlderThan(5*time.Millisecond, time.Millisecond)
	defer stop()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := roundTrip(c, r, "old"); err != nil {
			break // cut, as it should be
		}
		if time.Now().After(deadline) {
			t.Fatal("a connection older than the age was never cut")
		}
		time.Sleep(time.Millisecond)
	}
	if p.Cuts() == 0 {
		t.Error("Cuts = 0 after a cut")
	}
}
