package checker

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync/atomic"
	"time"
)

// Defaults for Options fields left at their zero value.
const (
	DefaultMethod      = http.MethodPost
	DefaultBody        = `{"cart_id":"{{marker}}","total_cents":1900}`
	DefaultKeyHeader   = "Idempotency-Key"
	DefaultTimeout     = 10 * time.Second
	DefaultConcurrency = 50
	// MaxConcurrency bounds Options.Concurrency: every racing request holds its
	// own connection (a file descriptor on both ends).
	MaxConcurrency = 1000
	// LongKeyLength is the length of the keys the long_key case sends: one more
	// than the 255 characters docs/design.md §1 and Stripe allow.
	LongKeyLength = 256
	// HangupMinWait is the least time the first request must have waited for
	// its answer for the hangup case to find the endpoint slow enough to hang
	// up on in the middle of a request, without Options.HangupAfter.
	HangupMinWait = 10 * time.Millisecond
)

// The cases, in the order Run executes them. The names are stable: they appear in
// the table, in the JSON output and in Options.Only.
const (
	CaseFirstRequest    = "first_request"
	CaseReplay          = "replay"
	CaseChangedBody     = "changed_body"
	CaseNewKey          = "new_key"
	CaseMissingKey      = "missing_key"
	CaseLongKey         = "long_key"
	CaseHangup          = "hangup"
	CaseRace            = "race"
	CaseTenantIsolation = "tenant_isolation"
)

var caseOrder = []string{
	CaseFirstRequest, CaseReplay, CaseChangedBody, CaseNewKey,
	CaseMissingKey, CaseLongKey, CaseHangup, CaseRace, CaseTenantIsolation,
}

// CaseNames returns the names of all cases in the order Run executes them.
func CaseNames() []string { return slices.Clone(caseOrder) }

// ErrInvalidOptions is wrapped by every error Run returns for options it cannot
// use; the command line reports those as bad usage.
var ErrInvalidOptions = errors.New("checker: invalid options")

// Options says what to check and how. Only URL is required.
type Options struct {
	// URL is the endpoint under test, for example http://127.0.0.1:8080/orders.
	URL string

	// Method is the request method. Defaults to POST.
	Method string

	// Body is the request body template. "{{marker}}" is replaced by a marker
	// unique to each case of each run, "{{n}}" by a number unique to each
	// operation (key) of a run; retries of one operation send the same rendering.
	// Defaults to DefaultBody.
	Body string

	// Header is sent with every request: authentication, Content-Type (which
	// defaults to application/json) and so on. Defaults to none.
	Header http.Header

	// TenantBHeader holds the headers of a second tenant. For its requests they
	// replace the headers of the same name in Header. When empty, the
	// tenant_isolation case is skipped. Defaults to none.
	TenantBHeader http.Header

	// KeyHeader is the request header that carries the key.
	// Defaults to "Idempotency-Key".
	KeyHeader string

	// KeyOptional says that the endpoint accepts writes without a key, so the
	// missing_key case is skipped. Defaults to false: a missing key must get 400.
	KeyOptional bool

	// Timeout bounds each request, from sending it to reading the whole answer.
	// Defaults to 10 seconds.
	Timeout time.Duration

	// Concurrency is how many identical requests the race case releases at once.
	// Defaults to 50; at least 2, at most MaxConcurrency.
	Concurrency int

	// Rounds is how many times the race case runs, each with a fresh key and
	// marker; it fails on the first round that fails. Defaults to 1.
	Rounds int

	// CountURL, when set, is a GET URL template that lists the resources created
	// for a marker, for example http://h/orders?cart_id={{marker}}. It lets the
	// checker verify on the server that a race created exactly one resource.
	// It must contain {{marker}}, and so must Body. Defaults to none.
	CountURL string

	// CountPath says where the count is in CountURL's JSON answer: a dotted path
	// of object members and array indexes such as "orders" or "data.items"
	// leading to an array (its length is the count) or a number (the count).
	// Defaults to the first JSON array in the answer, in document order.
	CountPath string

	// HangupAfter is how long after sending a request the hangup case hangs
	// up: shorter than the endpoint takes to answer. Defaults to 0: half the
	// time the first request waited for its answer, when that was at least
	// HangupMinWait (otherwise the case is skipped).
	HangupAfter time.Duration

	// Only restricts the run to the named cases (see CaseNames); cases that need
	// the first request send it themselves (and fail when it is not answered
	// 2xx, if first_request is not among them). Defaults to all cases.
	Only []string

	// Progress, when set, receives a one-line progress indicator (rewritten with
	// carriage returns) while the race runs. Defaults to nil: no progress.
	Progress io.Writer
}

// options are validated Options with defaults applied.
type options struct {
	Options
	target *url.URL
	only   map[string]bool
}

func (o Options) validate() (*options, error) {
	v := &options{Options: o}
	c := &v.Options
	var errs []error
	u, err := url.Parse(c.URL)
	switch {
	case c.URL == "":
		errs = append(errs, errors.New("no URL; pass the endpoint to check, for example http://127.0.0.1:8080/orders"))
	case err != nil:
		errs = append(errs, fmt.Errorf("URL %q: %v", c.URL, err))
	case u.Scheme != "http" && u.Scheme != "https":
		errs = append(errs, fmt.Errorf("URL %q: use an http:// or https:// URL", c.URL))
	case u.Host == "":
		errs = append(errs, fmt.Errorf("URL %q has no host", c.URL))
	default:
		v.target = u
	}
	if c.Method == "" {
		c.Method = DefaultMethod
	}
	c.Method = strings.ToUpper(c.Method)
	if c.Method == http.MethodGet || c.Method == http.MethodHead {
		errs = append(errs, fmt.Errorf("method %s never writes; check the POST or PATCH endpoint that creates resources", c.Method))
	}
	if c.Body == "" {
		c.Body = DefaultBody
	}
	if c.KeyHeader == "" {
		c.KeyHeader = DefaultKeyHeader
	}
	c.KeyHeader = http.CanonicalHeaderKey(c.KeyHeader)
	if c.Timeout == 0 {
		c.Timeout = DefaultTimeout
	} else if c.Timeout < 0 {
		errs = append(errs, fmt.Errorf("timeout %v is negative", c.Timeout))
	}
	if c.Concurrency == 0 {
		c.Concurrency = DefaultConcurrency
	} else if c.Concurrency < 2 || c.Concurrency > MaxConcurrency {
		errs = append(errs, fmt.Errorf("concurrency %d: a race needs at least 2 requests and at most %d", c.Concurrency, MaxConcurrency))
	}
	if c.HangupAfter < 0 {
		errs = append(errs, fmt.Errorf("hang-up delay %v is negative", c.HangupAfter))
	}
	if c.Rounds == 0 {
		c.Rounds = 1
	} else if c.Rounds < 0 {
		errs = append(errs, fmt.Errorf("rounds %d is negative", c.Rounds))
	}
	if c.CountURL != "" {
		if !strings.Contains(c.CountURL, "{{marker}}") {
			errs = append(errs, fmt.Errorf("count URL %q has no {{marker}}; it must list only the resources of one marker, for example http://h/orders?cart_id={{marker}}", c.CountURL))
		} else if cu, err := url.Parse(strings.ReplaceAll(c.CountURL, "{{marker}}", "m")); err != nil || (cu.Scheme != "http" && cu.Scheme != "https") || cu.Host == "" {
			errs = append(errs, fmt.Errorf("count URL %q is not an absolute http(s) URL", c.CountURL))
		}
		if !strings.Contains(c.Body, "{{marker}}") {
			errs = append(errs, errors.New("a count URL needs {{marker}} in the body template, so that each case's resources can be told apart"))
		}
	}
	if len(c.TenantBHeader) > 0 {
		same := true
		for k, vals := range c.TenantBHeader {
			same = same && slices.Equal(c.Header[k], vals)
		}
		if same {
			errs = append(errs, errors.New("tenant B's headers are the same as tenant A's; give tenant B its own credentials"))
		}
	}
	if c.CountPath != "" && c.CountURL == "" {
		errs = append(errs, errors.New("a count path needs a count URL"))
	}
	if len(c.Only) > 0 {
		v.only = make(map[string]bool, len(c.Only))
		for _, name := range c.Only {
			if !slices.Contains(caseOrder, name) {
				errs = append(errs, fmt.Errorf("unknown case %q; the cases are %s", name, strings.Join(caseOrder, ", ")))
			}
			v.only[name] = true
		}
		// Named alone, it would be skipped and the run, having checked
		// nothing, would pass.
		if v.only[CaseTenantIsolation] && len(c.TenantBHeader) == 0 {
			errs = append(errs, fmt.Errorf("case %s needs a second tenant's headers (--tenant-b-header 'Authorization: Bearer <tenant B's token>')", CaseTenantIsolation))
		}
	}
	if len(errs) > 0 {
		return nil, fmt.Errorf("%w: %w", ErrInvalidOptions, errors.Join(errs...))
	}
	return v, nil
}

// Run checks the endpoint case by case and returns the report. Its error wraps
// ErrInvalidOptions when opts cannot be used (nothing was sent then), or is the
// context's error when ctx ended; the report then holds the cases run so far. A
// misbehaving or unreachable server is not an error: it fails cases.
func Run(ctx context.Context, opts Options) (*Report, error) {
	o, err := opts.validate()
	if err != nil {
		return nil, err
	}
	c := &checker{o: o, run: "chk" + randomHex(5)}
	c.client = newClient(o.Timeout)
	defer c.client.CloseIdleConnections()
	rep := &Report{
		URL: o.URL, Method: o.Method, Run: c.run,
		Concurrency: o.Concurrency, Rounds: o.Rounds, Started: time.Now(),
	}
	for _, name := range caseOrder {
		if o.only != nil && !o.only[name] {
			continue
		}
		if err := ctx.Err(); err != nil {
			rep.Took = time.Since(rep.Started)
			return rep, err
		}
		start := time.Now()
		cs := c.runCase(ctx, name)
		cs.Name = name
		cs.Took = time.Since(start)
		rep.Cases = append(rep.Cases, cs)
	}
	rep.Took = time.Since(rep.Started)
	return rep, ctx.Err()
}

// checker carries the state of one run.
type checker struct {
	o      *options
	run    string // unique per run; prefixes markers
	client *http.Client
	ops    atomic.Int64 // numbers operations for {{n}}

	firstDone bool
	first     *exchange // the first request, once sent
	// replayHeader is set once an answer carried Idempotent-Replayed: true, so
	// the server is known to mark its replays.
	replayHeader bool
	// probed is set once learnMarking sent its probe.
	probed bool
	// execWait is the shortest wait for the answer of an execution (a fresh
	// key answered 2xx without a replay mark), 0 before the first.
	execWait time.Duration
}

// executed notes the wait of e when it is an execution.
func (c *checker) executed(e *exchange) {
	if e.ok() && !e.replayed() && e.wait > 0 && (c.execWait == 0 || e.wait < c.execWait) {
		c.execWait = e.wait
	}
}

func (c *checker) runCase(ctx context.Context, name string) Case {
	switch name {
	case CaseFirstRequest:
		return c.checkFirst(ctx)
	case CaseReplay:
		return c.checkReplay(ctx)
	case CaseChangedBody:
		return c.checkChangedBody(ctx)
	case CaseNewKey:
		return c.checkNewKey(ctx)
	case CaseMissingKey:
		return c.checkMissingKey(ctx)
	case CaseLongKey:
		return c.checkLongKey(ctx)
	case CaseHangup:
		return c.checkHangup(ctx)
	case CaseRace:
		return c.checkRace(ctx)
	case CaseTenantIsolation:
		return c.checkTenant(ctx)
	}
	panic("checker: unknown case " + name)
}

// marker returns the marker of one case of this run.
func (c *checker) marker(suffix string) string { return c.run + "-" + suffix }

// render renders the body template for a new operation with the given marker.
func (c *checker) render(marker string) []byte {
	n := c.ops.Add(1)
	s := strings.ReplaceAll(c.o.Body, "{{marker}}", marker)
	s = strings.ReplaceAll(s, "{{n}}", fmt.Sprint(n))
	return []byte(s)
}

// templated reports whether the body template changes with the marker.
func (c *checker) templated() bool {
	return strings.Contains(c.o.Body, "{{marker}}") || strings.Contains(c.o.Body, "{{n}}")
}

// newKey returns a fresh key in UUID form.
func newKey() string {
	h := randomHex(16)
	return h[0:8] + "-" + h[8:12] + "-4" + h[13:16] + "-a" + h[17:20] + "-" + h[20:32]
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand.Read never fails
	return hex.EncodeToString(b)
}
