package deploy_test

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testenv"
	"go.yaml.in/yaml/v3"
)

// promtool returns the path of promtool (Debian's prometheus package ships it:
// apt-get install prometheus). Without it the test is skipped, or fails under
// IDEM_REQUIRE_SERVICES=1, as CI runs.
func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		msg := "promtool is not on PATH (install it with: apt-get install prometheus)"
		if testenv.Required() {
			t.Fatal(msg + "; IDEM_REQUIRE_SERVICES=1, so this is a failure")
		}
		t.Skip(msg)
	}
	return p
}

// TestPromtoolRules runs `promtool check rules` on the shipped rules and
// `promtool test rules` on their unit tests (prometheus-rules.test.yml),
// which show every alert firing where it should and silent where it should
// not, in the setups docs/operating.md names.
func TestPromtoolRules(t *testing.T) {
	t.Parallel()
	bin := promtool(t)
	for _, args := range [][]string{{"check", "rules", "prometheus-rules.yml"}, {"test", "rules", "prometheus-rules.test.yml"}} {
		out, err := exec.Command(bin, args...).CombinedOutput()
		if err != nil {
			t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
}

// TestEveryRuleHasUnitTests: each alert of prometheus-rules.yml has at least
// one promtool case where it fires and one where it stays silent.
func TestEveryRuleHasUnitTests(t *testing.T) {
	t.Parallel()
	var r rules
	raw, err := os.ReadFile("prometheus-rules.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &r); err != nil {
		t.Fatal(err)
	}
	var tests struct {
		RuleFiles []string `yaml:"rule_files"`
		Tests     []struct {
			Name      string `yaml:"name"`
			AlertTest []struct {
				Alert     string           `yaml:"alertname"`
				ExpAlerts []map[string]any `yaml:"exp_alerts"`
			} `yaml:"alert_rule_test"`
		} `yaml:"tests"`
	}
	raw, err = os.ReadFile("prometheus-rules.test.yml")
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(raw, &tests); err != nil {
		t.Fatal(err)
	}
	if len(tests.RuleFiles) != 1 || tests.RuleFiles[0] != "prometheus-rules.yml" {
		t.Fatalf("rule_files %v; want [prometheus-rules.yml]", tests.RuleFiles)
	}
	fires, silent := map[string]bool{}, map[string]bool{}
	for _, tc := range tests.Tests {
		for _, a := range tc.AlertTest {
			if len(a.ExpAlerts) > 0 {
				fires[a.Alert] = true
			} else {
				silent[a.Alert] = true
			}
		}
	}
	for _, g := range r.Groups {
		for _, rule := range g.Rules {
			if !fires[rule.Alert] || !silent[rule.Alert] {
				t.Errorf("alert %s: promtool cases where it fires: %v, where it is silent: %v; want both in prometheus-rules.test.yml", rule.Alert, fires[rule.Alert], silent[rule.Alert])
			}
		}
	}
}
