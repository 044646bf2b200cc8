//go:build !linux

package redisstore_test

import "os/exec"

// dieWithTest is a no-op where the OS has no parent-death signal; the test's
// cleanups kill the server.
func dieWithTest(*exec.Cmd) {}
