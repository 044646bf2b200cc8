package idemotel_test

import (
	"sort"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// series returns every exported series as name{label=value,…}, without the
// exporter's otel_scope_* labels.
func series(t *testing.T, reg *prometheus.Registry) []string {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				if !strings.HasPrefix(l.GetName(), "otel_scope_") {
					ls = append(ls, l.GetName()+"="+l.GetValue())
				}
			}
			out = append(out, f.GetName()+"{"+strings.Join(ls, ",")+"}")
		}
	}
	sort.Strings(out)
	return out
}

// TestPrometheusSeriesMatchIdemprom: beyond names and label names, every
// series (label values: each outcome and op, as the rules and the dashboard
// select them) idemotel exports through the OpenTelemetry Prometheus exporter
// is one idemprom exports, and none is missing.
func TestPrometheusSeriesMatchIdemprom(t *testing.T) {
	t.Parallel()
	promReg, otelReg := drivenRegistries(t)
	a, b := series(t, promReg), series(t, otelReg)
	am := map[string]bool{}
	for _, s := range a {
		am[s] = true
	}
	for _, s := range b {
		if !am[s] {
			t.Errorf("idemotel exports the series %s, which idemprom does not", s)
		}
		delete(am, s)
	}
	for s := range am {
		t.Errorf("idemprom exports the series %s, which idemotel does not", s)
	}
}
