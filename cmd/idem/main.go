// Command idem is the idem command line: a reference orders service, a
// conformance checker for any HTTP API, store maintenance, and benchmarks.
//
// Run `idem help` for the list of commands and `idem COMMAND --help` for each.
//
// Exit codes: 0 success; 1 the command ran and found a failure (a failed check,
// a store error); 2 bad usage (unknown command or flag, invalid flag value).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"github.com/redis/go-redis/v9"
)

// Exit codes, documented in the README.
const (
	exitOK      = 0
	exitFailure = 1
	exitUsage   = 2
)

// command is one subcommand. Each lives in its own file and registers itself in
// init.
type command struct {
	name    string
	summary string
	// run executes the command with its arguments (without the command name) and
	// returns the exit code. ctx ends on SIGINT or SIGTERM.
	run func(ctx context.Context, args []string, stdout, stderr io.Writer) int
}

var commands = map[string]*command{}

func register(c *command) {
	if _, dup := commands[c.name]; dup {
		panic("idem: command registered twice: " + c.name)
	}
	commands[c.name] = c
}

func main() {
	// go-redis logs every failed dial on its own, before the command can say
	// what is wrong and what to do; the commands report Redis errors themselves.
	redis.SetLogger(quietRedisLog{})
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// quietRedisLog drops go-redis's internal log lines.
type quietRedisLog struct{}

func (quietRedisLog) Printf(context.Context, string, ...any) {}

// run dispatches args to a command and returns the exit code: `idem help` and
// `idem --help` print the commands on stdout (0), `idem help COMMAND` is
// `idem COMMAND --help`; no command, an unknown one or extra words after
// `idem help COMMAND` are usage errors (2, on stderr).
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprintln(stderr, "idem: no command given; run `idem help` for the list, for example `idem demo`")
		return exitUsage
	}
	name := args[0]
	if name == "help" || name == "-h" || name == "--help" || name == "-help" {
		switch len(args) {
		case 1:
			usage(stdout)
			return exitOK
		case 2:
			c, ok := commands[args[1]]
			if !ok {
				return unknownCommand(stderr, "idem help: ", args[1])
			}
			return c.run(ctx, []string{"--help"}, stdout, stderr)
		default:
			fmt.Fprintf(stderr, "idem help: give one command, not %d words; for example `idem help %s`\n", len(args)-1, args[1])
			return exitUsage
		}
	}
	c, ok := commands[name]
	if !ok {
		return unknownCommand(stderr, "idem: ", name)
	}
	return c.run(ctx, args[1:], stdout, stderr)
}

// unknownCommand reports a name that is no command, with the nearest one, and
// returns exitUsage.
func unknownCommand(stderr io.Writer, prefix, name string) int {
	if strings.HasPrefix(name, "-") {
		fmt.Fprintf(stderr, "%sflags go after the command, as in `idem demo %s`; run `idem help` for the commands\n", prefix, name)
		return exitUsage
	}
	hint := ""
	if near := nearestCommand(name); near != "" {
		hint = fmt.Sprintf(" (did you mean %q?)", near)
	}
	fmt.Fprintf(stderr, "%sunknown command %q%s; the commands are %s; run `idem help` for what each does\n",
		prefix, name, hint, strings.Join(commandNames(), ", "))
	return exitUsage
}

// nearestCommand returns the command within two edits of name, or one that name
// is a prefix of, or "".
func nearestCommand(name string) string {
	best, bestDist := "", 3
	for _, n := range commandNames() {
		d := editDistance(strings.ToLower(name), n)
		if len(name) >= 2 && strings.HasPrefix(n, strings.ToLower(name)) {
			d = min(d, 1)
		}
		if d < bestDist {
			best, bestDist = n, d
		}
	}
	return best
}

// editDistance is the Levenshtein distance of a and b.
func editDistance(a, b string) int {
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

func commandNames() []string {
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "idem makes retried writes safe. Usage: idem COMMAND [flags]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Commands:")
	for _, n := range commandNames() {
		fmt.Fprintf(w, "  %-10s  %s\n", n, commands[n].summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run `idem help COMMAND` (or `idem COMMAND --help`) for a command's flags.")
	fmt.Fprintln(w, "Exit codes: 0 ok, 1 the command ran and found a failure, 2 bad usage (the message on stderr says what to change).")
}

// flagErrorMessage turns an error of flag.FlagSet.Parse into a message that
// names flags as --name and says what a valid value looks like.
func flagErrorMessage(fs *flag.FlagSet, err error) string {
	msg := err.Error()
	if m := flagBadValueRE.FindStringSubmatch(msg); m != nil {
		value, name, detail := m[1], m[2], m[3]
		hint := flagHint(fs, name)
		if detail == "parse error" || detail == "value out of range" {
			return fmt.Sprintf("invalid value %s for --%s; %s", value, name, hint)
		}
		return fmt.Sprintf("invalid value %s for --%s: %s", value, name, detail)
	}
	if name, ok := strings.CutPrefix(msg, "flag provided but not defined: -"); ok {
		name = strings.TrimLeft(name, "-")
		if near := nearestFlag(fs, name); near != "" {
			return fmt.Sprintf("unknown flag --%s (did you mean --%s?)", name, near)
		}
		return fmt.Sprintf("unknown flag --%s", name)
	}
	if name, ok := strings.CutPrefix(msg, "flag needs an argument: -"); ok {
		return fmt.Sprintf("--%s needs a value, as in --%s=VALUE", name, name)
	}
	return msg
}

// flagBadValueRE matches the flag package's errors for a value it cannot parse.
var flagBadValueRE = regexp.MustCompile(`^invalid (?:boolean )?value (".*") for (?:flag )?-([\w-]+): (.*)$`)

// nearestFlag returns the flag of fs within two edits of name, or "".
func nearestFlag(fs *flag.FlagSet, name string) string {
	best, bestDist := "", 3
	fs.VisitAll(func(f *flag.Flag) {
		if d := editDistance(name, f.Name); d < bestDist {
			best, bestDist = f.Name, d
		}
	})
	return best
}

// listenAddrProblem says what is wrong with a host:port to listen on, or returns
// "" when it looks usable: an address that cannot work is bad usage (exit 2),
// unlike one that is busy (exit 1).
func listenAddrProblem(flagName, addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Sprintf("%s %q is not HOST:PORT; write for example 127.0.0.1:8080, :8080, or 127.0.0.1:0 for a free port", flagName, addr)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 0 || n > 65535 {
		return fmt.Sprintf("%s %q: port %q is not a number from 0 to 65535; write for example %s", flagName, addr, port, net.JoinHostPort(host, "8080"))
	}
	return ""
}

// parseFlags applies the environment variables of env, then parses args: flags
// may follow positional arguments, and after "--" everything is positional. It
// returns the positional arguments; ok is false when the command must stop with
// code: after --help (0, fs.Usage on stdout) or a usage error (2, on stderr,
// naming flags as --name and saying what a valid value looks like).
func parseFlags(fs *flag.FlagSet, args []string, env []storeEnvVar, stdout, stderr io.Writer) (pos []string, code int, ok bool) {
	fs.SetOutput(io.Discard)
	for _, e := range env {
		v, set := os.LookupEnv(e.env)
		if !set {
			continue
		}
		if err := fs.Set(e.flag, v); err != nil {
			return nil, storeUsageError(stderr, fs, fmt.Sprintf("%s=%q is not a valid value for --%s; %s", e.env, v, e.flag, flagHint(fs, e.flag))), false
		}
	}
	for {
		err := fs.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			fs.SetOutput(stdout)
			fs.Usage()
			fs.SetOutput(io.Discard)
			return nil, exitOK, false
		}
		if err != nil {
			return nil, storeUsageError(stderr, fs, flagErrorMessage(fs, err)), false
		}
		rest := fs.Args()
		if consumed := args[:len(args)-len(rest)]; len(consumed) > 0 && consumed[len(consumed)-1] == "--" {
			return append(pos, rest...), 0, true
		}
		if len(rest) == 0 {
			return pos, 0, true
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// flagHint says what a valid value of the named flag looks like.
func flagHint(fs *flag.FlagSet, name string) string {
	if f := fs.Lookup(name); f != nil {
		if _, ok := f.Value.(flag.Getter); ok {
			return storeHint(fs, name)
		}
	}
	return "run with --help for what it takes"
}

func init() {
	register(&command{
		name:    "completion",
		summary: "print a bash completion script for idem's commands and flags (eval it in ~/.bashrc)",
		run:     runCompletion,
	})
}

const completionUsage = `Usage: idem completion bash

Prints a bash completion script: commands after "idem", each command's flags
after "idem COMMAND --", file names elsewhere. It asks the idem it completes
for its commands and flags (idem help, idem COMMAND --help), so it stays right
as commands change. zsh reads it after "autoload -U bashcompinit && bashcompinit".

Example:
  echo 'eval "$(idem completion bash)"' >> ~/.bashrc

Exit codes: 0 printed, 2 bad usage.
`

// completionBash completes from the output of `idem help` (lines "  NAME  …")
// and `idem COMMAND --help` (lines "  --FLAG …"), which storeUsage prints.
const completionBash = `# bash completion for idem; eval "$(idem completion bash)"
_idem() {
	local cur=${COMP_WORDS[COMP_CWORD]} idem=${COMP_WORDS[0]} words
	if [ "$COMP_CWORD" -eq 1 ]; then
		words=$("$idem" help 2>/dev/null | sed -n 's/^  \([a-z][a-z0-9-]*\) .*/\1/p')
		COMPREPLY=($(compgen -W "$words help" -- "$cur"))
	elif [ "${COMP_WORDS[1]}" = help ] && [ "$COMP_CWORD" -eq 2 ]; then
		words=$("$idem" help 2>/dev/null | sed -n 's/^  \([a-z][a-z0-9-]*\) .*/\1/p')
		COMPREPLY=($(compgen -W "$words" -- "$cur"))
	elif [[ $cur == -* ]]; then
		words=$("$idem" "${COMP_WORDS[1]}" --help 2>/dev/null | sed -n 's/^  \(--[a-z0-9-]*\).*/\1/p')
		COMPREPLY=($(compgen -W "$words" -- "$cur"))
	else
		COMPREPLY=($(compgen -f -- "$cur"))
	fi
}
complete -o filenames -F _idem idem
`

func runCompletion(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("idem completion", flag.ContinueOnError)
	fs.Usage = storeUsage(fs, completionUsage, nil)
	pos, code, ok := parseFlags(fs, args, nil, stdout, stderr)
	if !ok {
		return code
	}
	if len(pos) != 1 || pos[0] != "bash" {
		return storeUsageError(stderr, fs, fmt.Sprintf("give the shell: idem completion bash (got %q); zsh reads the bash script after bashcompinit", strings.Join(pos, " ")))
	}
	fmt.Fprint(stdout, completionBash)
	return exitOK
}
