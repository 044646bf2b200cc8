package main

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/checker/checkertest"
)

func runCheckCmd(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(context.Background(), append([]string{"check"}, args...), &out, &errOut)
	return code, out.String(), errOut.String()
}

func TestCheckCorrectServer(t *testing.T) {
	t.Parallel()
	srv := checkertest.NewServer(checkertest.Correct)
	defer srv.Close()
	code, out, errOut := runCheckCmd(t,
		"--header", "Authorization: Bearer tenant-a",
		srv.URL+"/orders", // flags before and after the URL
		"--tenant-b-header", "Authorization: Bearer tenant-b",
		"--count-url", srv.URL+"/orders?cart_id={{marker}}",
		"--concurrency", "20",
		"--progress",
	)
	if code != exitOK {
		t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitOK, out, errOut)
	}
	for _, want := range []string{
		"CASE", "RESULT", "first_request", "replay", "changed_body", "new_key", "missing_key",
		"long_key", "hangup", "race", "tenant_isolation", "9 passed, 0 warnings, 0 failed, 0 skipped", ": ok",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if !strings.Contains(errOut, "20/20 answered") {
		t.Errorf("--progress wrote %q to stderr", errOut)
	}
}

func TestCheckBrokenServerJSON(t *testing.T) {
	t.Parallel()
	srv := checkertest.NewServer(checkertest.CheckThenWrite)
	defer srv.Close()
	code, out, errOut := runCheckCmd(t, srv.URL+"/orders", "--json",
		"--header", "Authorization: Bearer tenant-a", "--concurrency=10")
	if code != exitFailure {
		t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", code, exitFailure, out, errOut)
	}
	if errOut != "" {
		t.Errorf("stderr without --progress and a terminal: %q", errOut)
	}
	var rep struct {
		Failed bool `json:"failed"`
		Cases  []struct {
			Name     string   `json:"name"`
			Result   string   `json:"result"`
			Evidence []string `json:"evidence"`
		} `json:"cases"`
	}
	if err := json.Unmarshal([]byte(out), &rep); err != nil {
		t.Fatalf("stdout is not JSON: %v\n%s", err, out)
	}
	if !rep.Failed {
		t.Error(`"failed" is false`)
	}
	var failed []string
	for _, c := range rep.Cases {
		if c.Result == "fail" && c.Name != "hangup" { // its 409 poll may land in the check-then-write gap
			failed = append(failed, c.Name)
		}
		if c.Name == "tenant_isolation" && c.Result != "skip" {
			t.Errorf("tenant_isolation = %s without --tenant-b-header, want skip", c.Result)
		}
	}
	if len(failed) != 1 || failed[0] != "race" {
		t.Errorf("failed cases %v, want [race]\n%s", failed, out)
	}
}

func TestCheckOnlyAndRequireKey(t *testing.T) {
	t.Parallel()
	srv := checkertest.NewServer(checkertest.Correct)
	defer srv.Close()
	code, out, _ := runCheckCmd(t, srv.URL+"/orders", "--header", "Authorization: Bearer a",
		"--only", "missing_key, replay", "--require-key=false")
	if code != exitOK {
		t.Fatalf("exit %d\n%s", code, out)
	}
	if !strings.Contains(out, "1 passed, 0 warnings, 0 failed, 1 skipped") || strings.Contains(out, "race") {
		t.Errorf("--only missing_key,replay with --require-key=false:\n%s", out)
	}
}

func TestCheckUsage(t *testing.T) {
	t.Parallel()
	tests := map[string][]string{
		"no URL":          {},
		"two URLs":        {"http://a/", "http://b/"},
		"unknown flag":    {"http://a/", "--nope"},
		"bad header":      {"http://a/", "--header", "no colon here"},
		"bad concurrency": {"http://a/", "--concurrency", "1"},
		"bad timeout":     {"http://a/", "--timeout", "soon"},
		"bad hang-up":     {"http://a/", "--hangup-after", "-1s"},
		"unknown case":    {"http://a/", "--only", "race,racy"},
		"tenants alone":   {"http://a/", "--only", "tenant_isolation"},
		"bad URL":         {"localhost:8080/orders"},
	}
	for name, args := range tests {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			code, out, errOut := runCheckCmd(t, args...)
			if code != exitUsage {
				t.Errorf("exit %d, want %d", code, exitUsage)
			}
			if out != "" {
				t.Errorf("stdout on bad usage: %q", out)
			}
			if !strings.HasPrefix(errOut, "idem check: ") {
				t.Errorf("stderr does not say what is wrong: %q", errOut)
			}
		})
	}
}

func TestCheckHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"check", "--help"}, {"help", "check"}} {
		var out, errOut bytes.Buffer
		code := run(context.Background(), args, &out, &errOut)
		if code != exitOK {
			t.Errorf("%v: exit %d, want %d", args, code, exitOK)
		}
		for _, want := range []string{"Usage: idem check URL [flags]", "Example:", "--count-url", "-concurrency", "tenant_isolation"} {
			if !strings.Contains(out.String(), want) {
				t.Errorf("%v: usage lacks %q:\n%s", args, want, out.String())
			}
		}
	}
	var out bytes.Buffer
	run(context.Background(), []string{"help"}, &out, &out)
	if !strings.Contains(out.String(), "check") {
		t.Errorf("idem help does not list check:\n%s", out.String())
	}
}

// TestCheckAgainstDemo points the built `idem check` at the built `idem demo`:
// the reference service passes every case, the race five rounds in a row, with
// the orders counted on the server.
func TestCheckAgainstDemo(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	demo := startDemo(t, dir, nil, "--db", "sqlite:"+dir+"/demo.db", "--handler-delay", "30ms")
	code, out, errOut := runIdem(t, dir, nil, "check", demo.URL+"/orders",
		"--header", "Authorization: Bearer tenant-a",
		"--tenant-b-header", "Authorization: Bearer tenant-b",
		"--count-url", demo.URL+"/orders?cart_id={{marker}}",
		"--concurrency", "30", "--rounds", "5")
	if code != exitOK {
		t.Fatalf("idem check against idem demo: exit %d\nstdout:\n%s\nstderr:\n%s\ndemo:\n%s", code, out, errOut, demo.output())
	}
	if !strings.Contains(out, "9 passed, 0 warnings, 0 failed") {
		t.Errorf("want every case passed without warnings:\n%s", out)
	}
	t.Logf("report:\n%s", out)
}

// TestCheckHangupAfter: --hangup-after reaches the hangup case; a server whose
// hang-up rolls the order back and frees the key fails it (exit 1).
func TestCheckHangupAfter(t *testing.T) {
	t.Parallel()
	for flaw, want := range map[checkertest.Flaw]int{checkertest.Correct: exitOK, checkertest.HangupRollsBack: exitFailure} {
		srv := checkertest.NewServer(flaw)
		code, out, errOut := runCheckCmd(t, srv.URL+"/orders", "--header", "Authorization: Bearer a",
			"--only", "hangup", "--hangup-after", "5ms")
		srv.Close()
		if code != want || !strings.Contains(out, "hangup") {
			t.Errorf("%s: exit %d, want %d\n%s%s", flaw, code, want, out, errOut)
		}
	}
}
