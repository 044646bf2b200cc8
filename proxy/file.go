package proxy

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// File is a proxy configuration file (YAML), for more than one route:
//
//	listen: 127.0.0.1:8081
//	admin_addr: 127.0.0.1:9081  # /healthz and /metrics; empty: not served
//	upstream: http://127.0.0.1:3000
//	db: sqlite:keys.db          # or postgres://…, mysql://…
//	keys: redis://127.0.0.1:6379/0   # optional: the key records in Redis
//	repeat_safe: false          # true: a lapsed lease runs the operation again
//	upstream_timeout: 30s
//	upstream_idle_timeout: 1s   # below the upstream's keep-alive timeout
//	upstream_ca: ca.pem         # an https upstream's private CA
//	upstream_server_name: orders.internal
//	upstream_proxy: ""          # a forward proxy; HTTP_PROXY is ignored
//	trust_forwarded: [10.0.0.0/8]   # gateways whose X-Forwarded-Proto/-Host pass
//	preserve_host: false
//	key_unrouted: false         # true: key requests with a key that match no route
//	read_timeout: 60s
//	idle_timeout: 120s
//	scope:
//	  header: X-Tenant-ID       # or bearer: true, or jwt: {…}, or scope: none
//	routes:
//	  - match: POST /orders
//	    ttl: 24h
//	    lease: 30s
//	    in_flight_wait: 0s      # >0: a retry of a running request waits for its answer
//	    stored_headers: [Content-Type, Location]
//	    max_request_body: 1MiB
//	    max_stored_body: 1MiB
//	    release_status: [401, 403, 408, 425, 429]   # passed on, not kept
//	    release_5xx: false      # true: an upstream 5xx is not kept either
//	  - match: PATCH /orders/{id}
//	    key: optional
//
// Unknown fields are errors, as are a file with no document or more than one.
// Relative file paths (jwt.jwks_file, upstream_ca) are relative to the file's
// directory.
type File struct {
	Listen          string   `yaml:"listen"`
	Upstream        string   `yaml:"upstream"`
	DB              string   `yaml:"db"`
	Keys            string   `yaml:"keys"`
	Table           string   `yaml:"table"`
	RepeatSafe      bool     `yaml:"repeat_safe"`
	UpstreamTimeout Duration `yaml:"upstream_timeout"`
	// UpstreamIdleTimeout, UpstreamCA (a PEM file), UpstreamServerName and
	// UpstreamProxy configure the connections to the upstream.
	UpstreamIdleTimeout Duration `yaml:"upstream_idle_timeout"`
	UpstreamCA          string   `yaml:"upstream_ca"`
	UpstreamServerName  string   `yaml:"upstream_server_name"`
	UpstreamProxy       string   `yaml:"upstream_proxy"`
	// AdminAddr serves /healthz and /metrics.
	AdminAddr string `yaml:"admin_addr"`
	// TrustForwarded are CIDRs whose forwarding headers are passed on.
	TrustForwarded []string `yaml:"trust_forwarded"`
	PreserveHost   bool     `yaml:"preserve_host"`
	KeyUnrouted    bool     `yaml:"key_unrouted"`
	// ReadTimeout and IdleTimeout are the listener's.
	ReadTimeout Duration    `yaml:"read_timeout"`
	IdleTimeout Duration    `yaml:"idle_timeout"`
	Scope       FileScope   `yaml:"scope"`
	Routes      []FileRoute `yaml:"routes"`
	dir         string
}

// FileScope is the scope section of a File; at most one source may be set.
// "scope: none" (None) says that every caller shares one key space.
type FileScope struct {
	Header string   `yaml:"header"`
	Bearer bool     `yaml:"bearer"`
	JWT    *FileJWT `yaml:"jwt"`
	None   bool     `yaml:"-"`
}

// UnmarshalYAML reads "scope: none" or a mapping with one source.
func (s *FileScope) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode {
		if n.Value != "none" {
			return fmt.Errorf("line %d: scope %q: write none, or a mapping with one of header, bearer and jwt", n.Line, n.Value)
		}
		s.None = true
		return nil
	}
	if n.Kind != yaml.MappingNode {
		return fmt.Errorf("line %d: scope: write none, or a mapping with one of header, bearer and jwt", n.Line)
	}
	if err := checkKeys(n, "scope", "header", "bearer", "jwt"); err != nil {
		return err
	}
	type plain FileScope
	return n.Decode((*plain)(s))
}

// checkKeys refuses a key of mapping n (merged mappings, "<<: *anchor",
// included) that is not among allowed. A custom UnmarshalYAML decodes with a
// decoder of its own, which does not refuse unknown fields as the file's does:
// without this, a misspelt "audiance:" would be dropped, and tokens for any
// audience accepted.
func checkKeys(n *yaml.Node, where string, allowed ...string) error {
	for n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	switch n.Kind {
	case yaml.SequenceNode: // "<<: [*a, *b]"
		for _, c := range n.Content {
			if err := checkKeys(c, where, allowed...); err != nil {
				return err
			}
		}
		return nil
	case yaml.MappingNode:
	default:
		return nil // not a mapping: the decoder says so
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k := n.Content[i]
		if k.Kind == yaml.ScalarNode && k.ShortTag() == "!!merge" {
			if err := checkKeys(n.Content[i+1], where, allowed...); err != nil {
				return err
			}
			continue
		}
		if !slices.Contains(allowed, k.Value) {
			return fmt.Errorf("line %d: field %s not found in %s; use %s", k.Line, k.Value, where, strings.Join(allowed, ", "))
		}
	}
	return nil
}

// FileJWT configures JWTScope from a File.
type FileJWT struct {
	JWKSFile string   `yaml:"jwks_file"`
	Claim    string   `yaml:"claim"`
	Issuer   string   `yaml:"issuer"`
	Audience string   `yaml:"audience"`
	Leeway   Duration `yaml:"leeway"`
	// MaxTokenAge is JWTConfig.MaxTokenAge; AllowNoExp JWTConfig.AllowNoExp.
	MaxTokenAge Duration `yaml:"max_token_age"`
	AllowNoExp  bool     `yaml:"allow_no_exp"`
}

// UnmarshalYAML reads the jwt section, refusing unknown fields.
func (j *FileJWT) UnmarshalYAML(n *yaml.Node) error {
	if err := checkKeys(n, "scope.jwt", "jwks_file", "claim", "issuer", "audience", "leeway", "max_token_age", "allow_no_exp"); err != nil {
		return err
	}
	type plain FileJWT
	return n.Decode((*plain)(j))
}

// FileRoute is one route of a File.
type FileRoute struct {
	Match          string   `yaml:"match"`
	Key            string   `yaml:"key"` // required (default) or optional
	TTL            Duration `yaml:"ttl"`
	Lease          Duration `yaml:"lease"`
	InFlightWait   Duration `yaml:"in_flight_wait"`
	StoredHeaders  []string `yaml:"stored_headers"`
	MaxRequestBody Size     `yaml:"max_request_body"`
	MaxStoredBody  Size     `yaml:"max_stored_body"`
	ReleaseStatus  []int    `yaml:"release_status"`
	Release5xx     bool     `yaml:"release_5xx"`
}

// Duration is a time.Duration written as "30s", "24h".
type Duration time.Duration

// UnmarshalYAML parses a Go duration string.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	v, err := time.ParseDuration(n.Value)
	if err != nil || v < 0 {
		return fmt.Errorf("line %d: %q is not a duration; write one such as 30s, 5m or 24h", n.Line, n.Value)
	}
	*d = Duration(v)
	return nil
}

// Size is a byte count written as 1048576, "64KiB" or "1MiB".
type Size int64

// UnmarshalYAML parses a size.
func (s *Size) UnmarshalYAML(n *yaml.Node) error {
	v, err := ParseSize(n.Value)
	if err != nil {
		return fmt.Errorf("line %d: %v", n.Line, err)
	}
	*s = Size(v)
	return nil
}

var sizeUnits = []struct {
	suffix string
	mul    int64
}{{"KiB", 1 << 10}, {"MiB", 1 << 20}, {"GiB", 1 << 30}}

// ParseSize parses a positive byte count: a number, optionally followed by
// KiB, MiB or GiB.
func ParseSize(s string) (int64, error) {
	num, mul := strings.TrimSpace(s), int64(1)
	for _, u := range sizeUnits { // one suffix at most: "1MiBKiB" is no size
		if v, ok := strings.CutSuffix(num, u.suffix); ok {
			num, mul = strings.TrimSpace(v), u.mul
			break
		}
	}
	n, err := strconv.ParseInt(num, 10, 64)
	if err != nil || n <= 0 || n > (1<<40)/mul {
		return 0, fmt.Errorf("%q is not a size; write a positive number of bytes, or one with KiB, MiB or GiB (such as 1MiB)", s)
	}
	return n * mul, nil
}

// LoadFile reads and checks a configuration file.
func LoadFile(path string) (*File, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	dec := yaml.NewDecoder(bytes.NewReader(b))
	dec.KnownFields(true)
	f := &File{dir: filepath.Dir(path)}
	if err := dec.Decode(f); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("%s is empty; write at least upstream: and db: (see idem proxy --help)", path)
		}
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var doc yaml.Node
	if err := yaml.Unmarshal(b, &doc); err == nil && (len(doc.Content) == 0 || doc.Content[0].ShortTag() == "!!null") {
		return nil, fmt.Errorf("%s is empty (a document with nothing in it); write at least upstream: and db: (see idem proxy --help)", path)
	}
	var more yaml.Node
	if err := dec.Decode(&more); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s holds more than one YAML document (a second \"---\"); the proxy reads one: merge them, or remove the extra", path)
	}
	for _, c := range f.TrustForwarded {
		if _, err := ParsePrefix(c); err != nil {
			return nil, fmt.Errorf("%s: trust_forwarded: %w", path, err)
		}
	}
	if _, err := f.ProxyRoutes(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	n := 0
	if f.Scope.Header != "" {
		n++
		if err := CheckScopeHeader(f.Scope.Header); err != nil {
			return nil, fmt.Errorf("%s: scope.header: %w", path, err)
		}
	}
	if f.Scope.Bearer {
		n++
	}
	if f.Scope.JWT != nil {
		n++
		if f.Scope.JWT.JWKSFile == "" {
			return nil, fmt.Errorf("%s: scope.jwt needs jwks_file: the issuer's public keys, to verify tokens", path)
		}
	}
	if f.Scope.None {
		n++
	}
	if n > 1 {
		return nil, fmt.Errorf("%s: scope: set one of header, bearer and jwt", path)
	}
	return f, nil
}

// Path resolves a path given in the file (jwt.jwks_file, upstream_ca)
// against the file's directory.
func (f *File) Path(p string) string {
	if p == "" || filepath.IsAbs(p) || f.dir == "" {
		return p
	}
	return filepath.Join(f.dir, p)
}

// ParsePrefix parses a CIDR (10.0.0.0/8) or a single address (127.0.0.1).
func ParsePrefix(s string) (netip.Prefix, error) {
	s = strings.TrimSpace(s)
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Masked(), nil
	}
	if a, err := netip.ParseAddr(s); err == nil {
		a = a.Unmap()
		return netip.PrefixFrom(a, a.BitLen()), nil
	}
	return netip.Prefix{}, fmt.Errorf("%q is not a CIDR such as 10.0.0.0/8 or an address such as 127.0.0.1", s)
}

// ProxyRoutes returns the file's routes as Routes.
func (f *File) ProxyRoutes() ([]Route, error) {
	var out []Route
	for i, r := range f.Routes {
		if strings.TrimSpace(r.Match) == "" {
			return nil, fmt.Errorf("route %d: match is empty; write a pattern such as \"POST /orders\"", i+1)
		}
		rt := Route{
			Pattern: r.Match, TTL: time.Duration(r.TTL), Lease: time.Duration(r.Lease), InFlightWait: time.Duration(r.InFlightWait), StoredHeaders: r.StoredHeaders,
			MaxRequestBody: int64(r.MaxRequestBody), MaxStoredBody: int(r.MaxStoredBody), Release5xx: r.Release5xx,
			ReleaseStatus: r.ReleaseStatus,
		}
		switch r.Key {
		case "", "required":
		case "optional":
			rt.KeyOptional = true
		default:
			return nil, fmt.Errorf("route %d (%s): key %q: use required or optional", i+1, r.Match, r.Key)
		}
		out = append(out, rt)
	}
	return out, nil
}

// ProxyScope builds the file's Scope: NoScope() for "scope: none", nil when
// the file has no scope section.
func (f *File) ProxyScope() (Scope, error) {
	switch s := f.Scope; {
	case s.None:
		return NoScope(), nil
	case s.Header != "":
		return HeaderScope(s.Header), nil
	case s.Bearer:
		return BearerScope(), nil
	case s.JWT != nil:
		path := s.JWT.JWKSFile
		if !filepath.IsAbs(path) {
			path = filepath.Join(f.dir, path)
		}
		keys, err := LoadJWKS(path)
		if err != nil {
			return nil, err
		}
		return JWTScope(JWTConfig{Keys: keys, Claim: s.JWT.Claim, Issuer: s.JWT.Issuer, Audience: s.JWT.Audience, Leeway: time.Duration(s.JWT.Leeway),
			MaxTokenAge: time.Duration(s.JWT.MaxTokenAge), AllowNoExp: s.JWT.AllowNoExp})
	}
	return nil, nil
}
