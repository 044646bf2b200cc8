package bench

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// clockTick is the unit of utime and stime in /proc/<pid>/stat (USER_HZ, 100 on
// Linux).
const clockTick = 10_000_000 // ns

// selfCPU returns the CPU time (user + system) this process has used, in ns.
func selfCPU() int64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return -1
	}
	return ru.Utime.Nano() + ru.Stime.Nano()
}

// procCPU returns the CPU time (user + system) of process pid and of its threads,
// dead ones included, from /proc/<pid>/stat, in ns (10 ms resolution), or -1.
func procCPU(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return -1
	}
	// The command name may hold spaces: the fields start after the last ')'.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return -1
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 13 {
		return -1
	}
	ut, err1 := strconv.ParseInt(f[11], 10, 64)
	st, err2 := strconv.ParseInt(f[12], 10, 64)
	if err1 != nil || err2 != nil {
		return -1
	}
	return (ut + st) * clockTick
}

// threadCPU returns the time a single-threaded process (a PostgreSQL backend)
// spent on a CPU, in ns, from /proc/<pid>/schedstat, falling back to procCPU.
func threadCPU(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/schedstat")
	if err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			if ns, err := strconv.ParseInt(f[0], 10, 64); err == nil && ns > 0 {
				return ns
			}
		}
	}
	return procCPU(pid)
}

// procKiB returns the fields VmRSS and VmHWM (peak RSS) of /proc/<pid>/status, in KiB.
func procKiB(pid int) (rss, hwm int64) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return -1, -1
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "VmRSS":
			rss = n
		case "VmHWM":
			hwm = n
		}
	}
	return rss, hwm
}

// findProcess returns the PID of the first process whose command name is one of
// names (a database server on this machine), or 0.
func findProcess(names ...string) int {
	dirs, _ := filepath.Glob("/proc/[0-9]*/comm")
	for _, d := range dirs {
		b, err := os.ReadFile(d)
		if err != nil {
			continue
		}
		comm := strings.TrimSpace(string(b))
		for _, n := range names {
			if comm == n {
				pid, _ := strconv.Atoi(filepath.Base(filepath.Dir(d)))
				return pid
			}
		}
	}
	return 0
}
