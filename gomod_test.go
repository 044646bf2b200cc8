package idem_test

import (
	"os"
	"regexp"
	"testing"
)

// TestCoreModuleRequiresNothing keeps the core module's go.mod empty of
// requirements and at Go 1.25: every requirement here, even one only a test
// uses, would be in the module graph of every program that imports idem. A test
// that needs a store or another module belongs in internal/coretest
// (docs/modules.md); scripts/check-modules measures the graphs themselves.
func TestCoreModuleRequiresNothing(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("go.mod")
	if err != nil {
		t.Fatal(err)
	}
	if m := regexp.MustCompile(`(?m)^require\b.*$`).Find(b); m != nil {
		t.Errorf("the core module's go.mod has %q: move what needs it out of the core module (docs/modules.md)", m)
	}
	if !regexp.MustCompile(`(?m)^go 1\.25\.0$`).Match(b) {
		t.Errorf("the core module's go.mod must say go 1.25.0 (the oldest supported release); it has:\n%s", b)
	}
}
