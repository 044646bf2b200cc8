package deploy_test

import (
	"encoding/json"
	"os"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/idemkit/idem/idemprom"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/model"
	"go.yaml.in/yaml/v3"
)

// exported returns every series name idemprom exports (a histogram's as
// _bucket, _sum and _count) and the family names.
func exported(t *testing.T) (series, families map[string]bool) {
	t.Helper()
	reg := prometheus.NewRegistry()
	if _, err := idemprom.New(reg, nil); err != nil {
		t.Fatal(err)
	}
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	series, families = map[string]bool{}, map[string]bool{}
	for _, f := range fams {
		families[f.GetName()] = true
		if f.GetType() == dto.MetricType_HISTOGRAM {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				series[f.GetName()+s] = true
			}
			continue
		}
		series[f.GetName()] = true
	}
	if len(families) != 8 {
		t.Fatalf("idemprom exports %d families, want 8: %v", len(families), families)
	}
	return series, families
}

var metricRE = regexp.MustCompile(`\bidem_[a-z_]+\b`)

// checkExpr checks that expr names at least one metric, only exported ones,
// with balanced brackets; it returns the families it uses.
func checkExpr(t *testing.T, where, expr string, series map[string]bool) []string {
	t.Helper()
	names := metricRE.FindAllString(expr, -1)
	if len(names) == 0 {
		t.Errorf("%s: %q names no idem metric", where, expr)
	}
	var used []string
	for _, n := range names {
		if !series[n] {
			t.Errorf("%s: %q names %s, which idemprom does not export", where, expr, n)
		}
		used = append(used, strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count"))
	}
	for _, pair := range []string{"()", "[]", "{}"} {
		if strings.Count(expr, pair[:1]) != strings.Count(expr, pair[1:]) {
			t.Errorf("%s: %q has unbalanced %s", where, expr, pair)
		}
	}
	if strings.Contains(expr, `=~"`) && strings.Contains(expr, "key") {
		t.Errorf("%s: %q matches on a key label; idem has none", where, expr)
	}
	return used
}

type rules struct {
	Groups []struct {
		Name  string `yaml:"name"`
		Rules []struct {
			Alert       string            `yaml:"alert"`
			Expr        string            `yaml:"expr"`
			For         string            `yaml:"for"`
			Labels      map[string]string `yaml:"labels"`
			Annotations map[string]string `yaml:"annotations"`
		} `yaml:"rules"`
	} `yaml:"groups"`
}

// TestAlertRules parses prometheus-rules.yml as Prometheus would read it and
// checks each alert: an expression over exported metrics only, a valid "for",
// a severity and a summary; and that the alerts the operating guide promises
// exist.
func TestAlertRules(t *testing.T) {
	t.Parallel()
	series, _ := exported(t)
	raw, err := os.ReadFile("prometheus-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	var r rules
	dec := yaml.NewDecoder(strings.NewReader(string(raw)))
	dec.KnownFields(true) // a misspelt field is an error, as in promtool
	if err := dec.Decode(&r); err != nil {
		t.Fatalf("prometheus-rules.yml: %v", err)
	}
	alerts := map[string]bool{}
	for _, g := range r.Groups {
		if g.Name == "" || len(g.Rules) == 0 {
			t.Errorf("group %q: a group needs a name and rules", g.Name)
		}
		for _, rule := range g.Rules {
			where := "alert " + rule.Alert
			if rule.Alert == "" || !model.LabelValue(rule.Alert).IsValid() {
				t.Errorf("a rule without a valid alert name: %+v", rule)
			}
			if alerts[rule.Alert] {
				t.Errorf("%s: defined twice", where)
			}
			alerts[rule.Alert] = true
			checkExpr(t, where, rule.Expr, series)
			if rule.For != "" {
				if _, err := model.ParseDuration(rule.For); err != nil {
					t.Errorf("%s: for %q: %v", where, rule.For, err)
				}
			}
			if s := rule.Labels["severity"]; s != "warning" && s != "critical" {
				t.Errorf("%s: severity %q, want warning or critical", where, s)
			}
			if rule.Annotations["summary"] == "" || rule.Annotations["description"] == "" {
				t.Errorf("%s: needs a summary and a description", where)
			}
		}
	}
	for _, want := range []string{"IdemKeysStuckInFlight", "IdemInFlightNotDraining", "IdemStoreErrors", "IdemLeaseLost"} {
		if !alerts[want] {
			t.Errorf("no alert %s", want)
		}
	}
	doc, err := os.ReadFile("../docs/operating.md")
	if err != nil {
		t.Fatal(err)
	}
	for a := range alerts {
		if !strings.Contains(string(doc), a) {
			t.Errorf("docs/operating.md does not explain alert %s", a)
		}
	}
}

// TestDashboard parses grafana-dashboard.json and checks that every panel
// queries exported metrics only, and that every exported metric is shown.
func TestDashboard(t *testing.T) {
	t.Parallel()
	series, families := exported(t)
	raw, err := os.ReadFile("grafana-dashboard.json")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		UID    string `json:"uid"`
		Title  string `json:"title"`
		Panels []struct {
			ID      int    `json:"id"`
			Title   string `json:"title"`
			Type    string `json:"type"`
			Targets []struct {
				Expr  string `json:"expr"`
				RefID string `json:"refId"`
			} `json:"targets"`
		} `json:"panels"`
	}
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("grafana-dashboard.json: %v", err)
	}
	if d.UID == "" || d.Title == "" || len(d.Panels) == 0 {
		t.Fatalf("dashboard needs a uid, a title and panels: %+v", d)
	}
	shown := map[string]bool{}
	ids := map[int]bool{}
	for _, p := range d.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if p.Title == "" || p.Type == "" || len(p.Targets) == 0 {
			t.Errorf("panel %d: needs a title, a type and targets", p.ID)
		}
		for _, tg := range p.Targets {
			for _, f := range checkExpr(t, "panel "+p.Title, tg.Expr, series) {
				shown[f] = true
			}
		}
	}
	var missing []string
	for f := range families {
		if !shown[f] {
			missing = append(missing, f)
		}
	}
	sort.Strings(missing)
	if len(missing) > 0 {
		t.Errorf("the dashboard shows no panel for %v", missing)
	}
}
