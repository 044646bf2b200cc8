package proxy

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// File is a proxy configuration file (YAML), for more than one route:
//
//	listen: 127.0.0.1:8081
//	upstream: http://127.0.0.1:3000
//	db: sqlite:keys.db          # or postgres://…, mysql://…
//	keys: redis://127.0.0.1:6379/0   # optional: the key records in Redis
//	repeat_safe: false          # true: a lapsed lease runs the operation again
//	upstream_timeout: 30s
//	scope:
//	  header: X-Tenant-ID       # or bearer: true, or jwt: {…}
//	routes:
//	  - match: POST /orders
//	    ttl: 24h
//	    lease: 30s
//	    stored_headers: [Content-Type, Location]
//	    max_request_body: 1MiB
//	    max_stored_body: 1MiB
//	    release_5xx: false      # true: an upstream 5xx is not kept; a retry runs again
//	  - match: PATCH /orders/{id}
//	    key: optional
//
// Unknown fields are errors. Relative file paths (jwt.jwks_file) are relative
// to the file's directory.
type File struct {
	Listen          string      `yaml:"listen"`
	Upstream        string      `yaml:"upstream"`
	DB              string      `yaml:"db"`
	Keys            string      `yaml:"keys"`
	Table           string      `yaml:"table"`
	RepeatSafe      bool        `yaml:"repeat_safe"`
	UpstreamTimeout Duration    `yaml:"upstream_timeout"`
	Scope           FileScope   `yaml:"scope"`
	Routes          []FileRoute `yaml:"routes"`
	dir             string
}

// FileScope is the scope section of a File; at most one source may be set.
type FileScope struct {
	Header string   `yaml:"header"`
	Bearer bool     `yaml:"bearer"`
	JWT    *FileJWT `yaml:"jwt"`
}

// FileJWT configures JWTScope from a File.
type FileJWT struct {
	JWKSFile string   `yaml:"jwks_file"`
	Claim    string   `yaml:"claim"`
	Issuer   string   `yaml:"issuer"`
	Audience string   `yaml:"audience"`
	Leeway   Duration `yaml:"leeway"`
}

// FileRoute is one route of a File.
type FileRoute struct {
	Match          string   `yaml:"match"`
	Key            string   `yaml:"key"` // required (default) or optional
	TTL            Duration `yaml:"ttl"`
	Lease          Duration `yaml:"lease"`
	StoredHeaders  []string `yaml:"stored_headers"`
	MaxRequestBody Size     `yaml:"max_request_body"`
	MaxStoredBody  Size     `yaml:"max_stored_body"`
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

// ParseSize parses a positive byte count: a number, optionally followed by
// KiB, MiB or GiB.
func ParseSize(s string) (int64, error) {
	num, mul := strings.TrimSpace(s), int64(1)
	for suffix, m := range map[string]int64{"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30} {
		if v, ok := strings.CutSuffix(num, suffix); ok {
			num, mul = strings.TrimSpace(v), m
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
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if _, err := f.ProxyRoutes(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	n := 0
	if f.Scope.Header != "" {
		n++
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
	if n > 1 {
		return nil, fmt.Errorf("%s: scope: set one of header, bearer and jwt", path)
	}
	return f, nil
}

// ProxyRoutes returns the file's routes as Routes.
func (f *File) ProxyRoutes() ([]Route, error) {
	var out []Route
	for i, r := range f.Routes {
		if strings.TrimSpace(r.Match) == "" {
			return nil, fmt.Errorf("route %d: match is empty; write a pattern such as \"POST /orders\"", i+1)
		}
		rt := Route{
			Pattern: r.Match, TTL: time.Duration(r.TTL), Lease: time.Duration(r.Lease), StoredHeaders: r.StoredHeaders,
			MaxRequestBody: int64(r.MaxRequestBody), MaxStoredBody: int(r.MaxStoredBody), Release5xx: r.Release5xx,
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

// ProxyScope builds the file's Scope; nil when the file sets none.
func (f *File) ProxyScope() (Scope, error) {
	switch s := f.Scope; {
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
		return JWTScope(JWTConfig{Keys: keys, Claim: s.JWT.Claim, Issuer: s.JWT.Issuer, Audience: s.JWT.Audience, Leeway: time.Duration(s.JWT.Leeway)})
	}
	return nil, nil
}
