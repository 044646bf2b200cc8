package sqliteoutbox_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/sqlitestore/embedded"
	"github.com/idemkit/idem/sqlitestore/sqliteoutbox"
)

const (
	envProcChild = "SQLITEOUTBOX_RELAY_CHILD"
	envProcStart = "SQLITEOUTBOX_RELAY_START"
	procSpan     = "SQLITEOUTBOX_SPAN "
)

// TestRelayProcChild is a relay process of TestRelayProcessesOneFile: it
// prints when each publication begins and ends.
func TestRelayProcChild(t *testing.T) {
	path := os.Getenv(envProcChild)
	if path == "" {
		t.Skip("the child process of TestRelayProcessesOneFile")
	}
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ob, err := sqliteoutbox.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	w := bufio.NewWriter(os.Stdout)
	say := func(f string, a ...any) {
		mu.Lock()
		fmt.Fprintf(w, procSpan+f+"\n", a...)
		_ = w.Flush()
		mu.Unlock()
	}
	if at, err := strconv.ParseInt(os.Getenv(envProcStart), 10, 64); err == nil {
		time.Sleep(time.Until(time.Unix(0, at)))
	}
	r := &outbox.Relay{Source: ob, Owner: "proc-" + strconv.Itoa(os.Getpid()), BatchSize: 10, Concurrency: 4,
		LeaseDuration: 10 * time.Second, PollInterval: 5 * time.Millisecond, StatsInterval: -1, Retention: -1,
		Observer: failLogger{say},
		Publisher: outbox.PublisherFunc(func(ctx context.Context, m *outbox.Stored) error {
			say("B %s %d %d", m.ID, m.Seq, time.Now().UnixNano())
			time.Sleep(time.Millisecond)
			say("E %s %d %d", m.ID, m.Seq, time.Now().UnixNano())
			return nil
		})}
	_ = r.Run(context.Background())
}

type failLogger struct{ say func(string, ...any) }

func (failLogger) Published(*outbox.Stored, time.Duration)     {}
func (failLogger) Failed(*outbox.Stored, error, time.Duration) {}
func (failLogger) DeadLettered(*outbox.Stored, string)         {}
func (failLogger) Batch(int, time.Duration)                    {}
func (failLogger) Deleted(int)                                 {}
func (failLogger) Stats(outbox.Stats)                          {}
func (l failLogger) SourceFailed(err error)                    { l.say("X %q", err.Error()) }

// TestRelayProcessesOneFile: two relay processes on one SQLite file,
// started at one instant (what docs/outbox.md calls safe but no faster):
// every message published, none by both processes at once, each partition
// in enqueue order.
func TestRelayProcessesOneFile(t *testing.T) {
	if testing.Short() {
		t.Skip("starts relay processes")
	}
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "shop.db")
	db, err := embedded.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ob, err := sqliteoutbox.New(db, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	const n, partitions, procs = 400, 10, 2
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if err := ob.Enqueue(ctx, tx, outbox.Message{ID: fmt.Sprintf("m%05d", i), Subject: "orders.created", PartitionKey: fmt.Sprint("p", i%partitions)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	startAt := time.Now().Add(2 * time.Second).UnixNano()
	type pub struct {
		proc       int
		seq        int64
		begin, end int64
	}
	var mu sync.Mutex
	pubs := map[string][]pub{}
	open := map[[2]string]int64{}
	var srcErrs []string
	var wg sync.WaitGroup
	var cmds []*exec.Cmd
	for p := range procs {
		cmd := exec.Command(os.Args[0], "-test.run=^TestRelayProcChild$", "-test.count=1")
		cmd.Env = append(os.Environ(), envProcChild+"="+path, envProcStart+"="+strconv.FormatInt(startAt, 10))
		cmd.Stderr = os.Stderr
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		cmds = append(cmds, cmd)
		wg.Add(1)
		go func() {
			defer wg.Done()
			sc := bufio.NewScanner(out)
			for sc.Scan() {
				rest, ok := strings.CutPrefix(sc.Text(), procSpan)
				if !ok {
					continue
				}
				f := strings.Fields(rest)
				mu.Lock()
				switch {
				case f[0] == "X":
					srcErrs = append(srcErrs, rest)
				case len(f) == 4 && f[0] == "B":
					ns, _ := strconv.ParseInt(f[3], 10, 64)
					open[[2]string{strconv.Itoa(p), f[1]}] = ns
				case len(f) == 4 && f[0] == "E":
					ns, _ := strconv.ParseInt(f[3], 10, 64)
					seq, _ := strconv.ParseInt(f[2], 10, 64)
					k := [2]string{strconv.Itoa(p), f[1]}
					pubs[f[1]] = append(pubs[f[1]], pub{proc: p, seq: seq, begin: open[k], end: ns})
					delete(open, k)
				}
				mu.Unlock()
			}
		}()
	}
	defer func() {
		for _, c := range cmds {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}()
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, err := ob.Stats(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if st.Pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d unpublished after 60 s", st.Pending, n)
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, c := range cmds {
		_ = c.Process.Kill()
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	if len(pubs) != n {
		t.Fatalf("%d messages published, want %d", len(pubs), n)
	}
	byProc := map[int]int{}
	var all []pub
	for id, ps := range pubs {
		if len(ps) > 1 {
			t.Errorf("%s published %d times with leases of 10 s and no crash", id, len(ps))
		}
		for i := range ps {
			byProc[ps[i].proc]++
			all = append(all, ps[i])
			for j := range i {
				if ps[i].begin < ps[j].end && ps[j].begin < ps[i].end {
					t.Fatalf("%s was being published by processes %d and %d at once", id, ps[i].proc, ps[j].proc)
				}
			}
		}
	}
	// Per partition (seq order = enqueue order), a publication begins only
	// after the previous message's ended.
	last := map[int64]pub{}
	for seq := int64(1); seq <= n; seq++ {
		for _, p := range all {
			if p.seq != seq {
				continue
			}
			part := (seq - 1) % partitions
			if prev, ok := last[part]; ok && p.begin < prev.end {
				t.Fatalf("partition p%d: seq %d began before seq %d ended", part, seq, prev.seq)
			}
			last[part] = p
		}
	}
	t.Logf("%d relay processes on one file: publications per process %v; source errors: %d %v", procs, byProc, len(srcErrs), srcErrs[:min(3, len(srcErrs))])
}
