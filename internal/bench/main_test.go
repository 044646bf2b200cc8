package bench

import (
	"context"
	"fmt"
	"os"
	"testing"
)

// TestMain lets the test binary be the server process of an isolated run: with
// ServeEnv set it serves instead of running the tests.
func TestMain(m *testing.M) {
	if spec := os.Getenv(ServeEnv); spec != "" {
		if err := Serve(context.Background(), spec, os.Stdin, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if spec := os.Getenv(LoadEnv); spec != "" {
		if err := Load(context.Background(), spec, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}
