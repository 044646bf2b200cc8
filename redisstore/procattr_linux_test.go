package redisstore_test

import (
	"os/exec"
	"syscall"
)

// dieWithTest makes a private redis-server die with the test binary, even when
// the binary is killed before its cleanups run.
func dieWithTest(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
