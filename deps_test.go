package idem_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestCoreIsStdlibOnly enforces that package idem imports nothing outside the
// standard library but the module's own internal packages (whose imports
// go list -deps lists too, so they are held to the same rule).
func TestCoreIsStdlibOnly(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	var outside []string
	for _, p := range strings.Fields(string(out)) {
		if p != "github.com/idemkit/idem" && !strings.HasPrefix(p, "github.com/idemkit/idem/internal/") {
			outside = append(outside, p)
		}
	}
	if len(outside) > 0 {
		t.Fatalf("package idem depends on non-standard packages: %v", outside)
	}
}
