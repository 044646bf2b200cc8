package bench

import (
	"context"
	"fmt"
	"net/http"
	"time"
)

// MemoryResult is what a fresh server process grew by while it stored Records
// answers of the orders handler.
type MemoryResult struct {
	Target  string `json:"target"`  // memory or fiber
	Variant string `json:"variant"` // baseline (no middleware) or first
	Records int64  `json:"records"` // requests sent, each with a fresh key (none for the baseline)
	// StartRSSKiB is the resident set after a warm-up; PeakRSSKiB the peak
	// (VmHWM) after the requests.
	StartRSSKiB int64 `json:"start_rss_kib"`
	PeakRSSKiB  int64 `json:"peak_rss_kib"`
	// PeakPerRecord is (PeakRSSKiB − StartRSSKiB) / Records, in bytes.
	PeakPerRecord float64 `json:"peak_rss_bytes_per_record"`
	// NetPerRecord is PeakPerRecord minus the baseline's of the same server
	// (what the orders themselves and the server's buffers cost): what the
	// middleware's records cost. 0 for the baselines.
	NetPerRecord float64 `json:"net_peak_rss_bytes_per_record"`
	// HeapPerRecord is the growth of the live heap (after a GC) per record, bytes.
	HeapPerRecord float64 `json:"live_heap_bytes_per_record"`
	Check         string  `json:"check,omitempty"`
}

// runMemory measures the memory per stored record of memstore and of Fiber's
// middleware: for each, a fresh server process, a warm-up of 1000 requests,
// then cfg.MemoryRecords first-time requests from 8 clients; the same on the bare
// handler of each server gives what the orders map and the server cost without
// the middleware.
func runMemory(ctx context.Context, cfg *Config, suffix string) ([]MemoryResult, error) {
	var out []MemoryResult
	kg := &keyGen{runID: randomHex(4)}
	base := map[string]float64{}
	for _, name := range []string{"memory", "fiber"} {
		for _, v := range []struct {
			name, path string
			keys       keyKind
		}{{VariantBaseline, "/bare/orders", keysNone}, {VariantFirst, "/idem/orders", keysFresh}} {
			m, err := memoryCell(ctx, cfg, suffix, kg, name, v.name, v.path, v.keys)
			if err != nil {
				return out, err
			}
			if v.keys == keysNone {
				base[name] = m.PeakPerRecord
			} else {
				m.NetPerRecord = m.PeakPerRecord - base[name]
			}
			fmt.Fprintf(cfg.Log, "memory   %-6s %-8s %d records: peak RSS %+.0f B/record, live heap %+.0f B/record\n", name, v.name, m.Records, m.PeakPerRecord, m.HeapPerRecord)
			out = append(out, m)
		}
	}
	return out, nil
}

func memoryCell(ctx context.Context, cfg *Config, suffix string, kg *keyGen, name, variant, path string, kind keyKind) (MemoryResult, error) {
	m := MemoryResult{Target: name, Variant: variant}
	t, _, err := startChild(ctx, name, cfg, suffix)
	if err != nil {
		return m, err
	}
	defer t.close()
	client := newClient(8)
	defer client.CloseIdleConnections()
	keys, _ := kg.keys(kind, nil)
	url := t.url + path
	warm := closedLoop(ctx, client, url, keys, 8, time.Minute, 1000)
	statsURL := t.url + statsPath
	before, err := fetchStats(ctx, client, statsURL, true)
	if err != nil {
		return m, err
	}
	s := closedLoop(ctx, client, url, keys, 8, time.Hour, int64(cfg.MemoryRecords))
	after, err := fetchStats(ctx, client, statsURL, true)
	if err != nil {
		return m, err
	}
	if err := ctx.Err(); err != nil {
		return m, err
	}
	n := int64(len(s.latencies))
	m.Records, m.StartRSSKiB, m.PeakRSSKiB = n, before.RSSKiB, after.PeakRSSKiB
	if n > 0 {
		m.PeakPerRecord = float64(after.PeakRSSKiB-before.RSSKiB) * 1024 / float64(n)
		m.HeapPerRecord = (float64(after.HeapLive) - float64(before.HeapLive)) / float64(n)
	}
	rows := after.Rows - before.Rows
	if s.other+warm.other > 0 || s.executed != n || rows != n {
		m.Check = fmt.Sprintf("%d requests: %d executed, %d rows, %d errors; want every request executed once", n, s.executed, rows, s.other)
		if s.status[fmt.Sprint(http.StatusConflict)] > 0 {
			m.Check += " (some got 409)"
		}
	}
	return m, nil
}
