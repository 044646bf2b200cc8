package proxy

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/go-jose/go-jose/v4"
	"github.com/go-jose/go-jose/v4/jwt"
)

// Scope gives the tenant of a keyed request: records are identified by (scope,
// key), so two tenants never share a key. An error refuses the request with 401
// (CodeScopeMissing when it wraps ErrNoScope, CodeScopeInvalid otherwise).
type Scope interface {
	Scope(r *http.Request) (string, error)
}

// ScopeFunc adapts a function to Scope.
type ScopeFunc func(r *http.Request) (string, error)

// Scope calls f.
func (f ScopeFunc) Scope(r *http.Request) (string, error) { return f(r) }

// ErrNoScope is wrapped by the errors of requests that carry no scope at all.
var ErrNoScope = errors.New("no scope")

// HeaderScope takes the scope from a request header, such as X-Tenant-ID, set by
// a gateway in front of the proxy that authenticated the caller. A missing or
// empty header is refused. Use it only when clients cannot set the header
// themselves. HeaderScope("Host") keys by the request's host (lower case,
// port included): one tenant per host name.
func HeaderScope(name string) Scope {
	name = http.CanonicalHeaderKey(name)
	if name == "Host" {
		// net/http moves Host out of the header map, into Request.Host.
		return ScopeFunc(func(r *http.Request) (string, error) {
			if h := strings.ToLower(strings.TrimSpace(r.Host)); h != "" {
				return h, nil
			}
			return "", fmt.Errorf("%w: send a Host header", ErrNoScope)
		})
	}
	return ScopeFunc(func(r *http.Request) (string, error) {
		if n := len(r.Header.Values(name)); n > 1 {
			// A gateway that appends its header after the client's would
			// otherwise let the client's line choose the scope.
			return "", fmt.Errorf("%d %s header lines were sent; send exactly one", n, name)
		}
		v := strings.TrimSpace(r.Header.Get(name))
		if v == "" {
			return "", fmt.Errorf("%w: send the tenant in the %s header", ErrNoScope, name)
		}
		return v, nil
	})
}

// BearerScope takes the scope from the bearer token (Authorization: Bearer
// TOKEN): one token, one tenant. The token is never stored: the scope is
// BearerScopeOf(token).
func BearerScope() Scope {
	return ScopeFunc(func(r *http.Request) (string, error) {
		if err := singleAuthorization(r); err != nil {
			return "", err
		}
		tok, ok := bearer(r)
		if !ok {
			return "", fmt.Errorf("%w: send Authorization: Bearer TOKEN", ErrNoScope)
		}
		return BearerScopeOf(tok), nil
	})
}

// BearerScopeOf is the scope BearerScope gives a request with token:
// "bearer-sha256:" and the token's SHA-256 in hex.
func BearerScopeOf(token string) string {
	sum := sha256.Sum256([]byte(token))
	return "bearer-sha256:" + hex.EncodeToString(sum[:])
}

// singleAuthorization refuses a request with more than one Authorization line
// (a singleton field, RFC 9110 §11.6.2): taking one of them would let whoever
// added the other choose the scope.
func singleAuthorization(r *http.Request) error {
	if n := len(r.Header.Values("Authorization")); n > 1 {
		return fmt.Errorf("%d Authorization header lines were sent; send exactly one", n)
	}
	return nil
}

func bearer(r *http.Request) (string, bool) {
	h := r.Header.Get("Authorization")
	if len(h) < 7 || !strings.EqualFold(h[:7], "bearer ") {
		return "", false
	}
	tok := strings.TrimSpace(h[7:])
	return tok, tok != ""
}

// JWTConfig configures JWTScope.
type JWTConfig struct {
	// Keys verify the token's signature; a token signed by no key in the set is
	// refused. Required.
	Keys *jose.JSONWebKeySet
	// Claim is the claim whose value is the scope, such as "sub" or "tenant_id";
	// it must be a non-empty string. Defaults to "sub".
	Claim string
	// Issuer, when set, must equal the token's iss.
	Issuer string
	// Audience, when set, must be among the token's aud.
	Audience string
	// Algorithms are the accepted signature algorithms. Defaults to RS256,
	// RS384, RS512, PS256, PS384, PS512, ES256, ES384, ES512 and EdDSA.
	Algorithms []jose.SignatureAlgorithm
	// Leeway is the clock skew allowed on exp, nbf and iat. Defaults to 30 s.
	Leeway time.Duration
	// AllowNoExp accepts tokens without an exp claim. Defaults to false: a
	// token that never expires is refused.
	AllowNoExp bool
	// MaxTokenAge is the longest lifetime accepted: a token whose exp is
	// further than this after its iat (or, without iat, after now) is refused.
	// Defaults to DefaultMaxTokenAge; negative for no bound.
	MaxTokenAge time.Duration
	// NowFunc is the clock. Defaults to time.Now.
	NowFunc func() time.Time
}

// DefaultMaxTokenAge is JWTConfig.MaxTokenAge when zero.
const DefaultMaxTokenAge = 24 * time.Hour

// DefaultJWTAlgorithms are the algorithms JWTScope accepts unless configured:
// the asymmetric ones (a proxy holds no shared secret).
var DefaultJWTAlgorithms = []jose.SignatureAlgorithm{
	jose.RS256, jose.RS384, jose.RS512, jose.PS256, jose.PS384, jose.PS512,
	jose.ES256, jose.ES384, jose.ES512, jose.EdDSA,
}

// JWTScope takes the scope from a claim of the bearer token, a JWT whose
// signature is verified with cfg.Keys and whose exp, nbf, iss and aud are
// checked. An unverified claim is never a scope: a token that fails any check
// is refused with 401.
func JWTScope(cfg JWTConfig) (Scope, error) {
	if cfg.Keys == nil || len(cfg.Keys.Keys) == 0 {
		return nil, errors.New("proxy: JWTScope needs a key set (a JWKS with at least one key) to verify tokens")
	}
	var sig []jose.JSONWebKey // the keys that verify signatures
	for i, k := range cfg.Keys.Keys {
		name := k.KeyID
		if name == "" {
			name = fmt.Sprint("number ", i+1)
		}
		if !k.Valid() {
			return nil, fmt.Errorf("proxy: JWKS key %q is not valid", name)
		}
		if _, sym := k.Key.([]byte); sym {
			return nil, fmt.Errorf("proxy: JWKS key %q is a symmetric (oct) key; give the issuer's public keys", name)
		}
		if k.Use != "" && k.Use != "sig" {
			continue // an encryption key (use: enc) never verifies a signature
		}
		sig = append(sig, k)
	}
	if len(sig) == 0 {
		return nil, errors.New("proxy: the JWKS has no signature key (every key is marked use: enc); give the issuer's signing keys")
	}
	if len(sig) > 1 {
		for i, k := range sig {
			if k.KeyID == "" {
				return nil, fmt.Errorf("proxy: JWKS signature key number %d has no kid; with more than one key every key needs a kid (tokens name theirs in their header)", i+1)
			}
		}
	}
	if cfg.MaxTokenAge == 0 {
		cfg.MaxTokenAge = DefaultMaxTokenAge
	}
	if cfg.Claim == "" {
		cfg.Claim = "sub"
	}
	if len(cfg.Algorithms) == 0 {
		cfg.Algorithms = DefaultJWTAlgorithms
	}
	if cfg.Leeway == 0 {
		cfg.Leeway = 30 * time.Second
	}
	if cfg.NowFunc == nil {
		cfg.NowFunc = time.Now
	}
	return ScopeFunc(func(r *http.Request) (string, error) {
		if err := singleAuthorization(r); err != nil {
			return "", err
		}
		raw, ok := bearer(r)
		if !ok {
			return "", fmt.Errorf("%w: send Authorization: Bearer JWT", ErrNoScope)
		}
		tok, err := jwt.ParseSigned(raw, cfg.Algorithms)
		if err != nil {
			return "", fmt.Errorf("the bearer token is not a JWT signed with an accepted algorithm: %v", err)
		}
		h := tok.Headers[0]
		key, err := pickKey(sig, h)
		if err != nil {
			return "", err
		}
		var std jwt.Claims
		var all map[string]json.RawMessage
		if err := tok.Claims(key.Key, &std, &all); err != nil {
			return "", errors.New("the bearer token's signature does not verify with the configured keys")
		}
		now := cfg.NowFunc()
		exp := jwt.Expected{Issuer: cfg.Issuer, Time: now}
		if cfg.Audience != "" {
			exp.AnyAudience = jwt.Audience{cfg.Audience}
		}
		if err := std.ValidateWithLeeway(exp, cfg.Leeway); err != nil {
			return "", fmt.Errorf("the bearer token is not valid here: %v", err)
		}
		if std.Expiry == nil && !cfg.AllowNoExp {
			return "", errors.New("the bearer token has no exp claim; the proxy accepts only tokens that expire")
		}
		if std.Expiry != nil && cfg.MaxTokenAge > 0 {
			from := now
			if std.IssuedAt != nil {
				from = std.IssuedAt.Time()
			}
			if life := std.Expiry.Time().Sub(from); life > cfg.MaxTokenAge+cfg.Leeway {
				return "", fmt.Errorf("the bearer token lives %v, longer than the %v the proxy accepts", life.Round(time.Second), cfg.MaxTokenAge)
			}
		}
		var scope string
		if err := json.Unmarshal(all[cfg.Claim], &scope); err != nil || scope == "" {
			return "", fmt.Errorf("the bearer token has no %q claim with a non-empty string value", cfg.Claim)
		}
		return scope, nil
	}), nil
}

// pickKey returns the key of keys that verifies a token with header h: the one
// its kid names (or the only key, when neither names one), refusing a key
// whose alg is not the token's.
func pickKey(keys []jose.JSONWebKey, h jose.Header) (jose.JSONWebKey, error) {
	var key *jose.JSONWebKey
	for i := range keys {
		if keys[i].KeyID == h.KeyID || (len(keys) == 1 && keys[i].KeyID == "") {
			key = &keys[i]
			break
		}
	}
	if key == nil {
		if h.KeyID == "" {
			return jose.JSONWebKey{}, errors.New("the bearer token names no key (no kid in its header), and the configured key set has more than one")
		}
		return jose.JSONWebKey{}, fmt.Errorf("the bearer token is signed with key %q, which is not a signature key of the configured key set", h.KeyID)
	}
	if key.Algorithm != "" && key.Algorithm != h.Algorithm {
		return jose.JSONWebKey{}, fmt.Errorf("the bearer token is signed with %s, but its key %q is for %s", h.Algorithm, key.KeyID, key.Algorithm)
	}
	return *key, nil
}

// LoadJWKS reads a JSON Web Key Set ({"keys":[…]}) from a file.
func LoadJWKS(path string) (*jose.JSONWebKeySet, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read the JWKS: %w", err)
	}
	var set jose.JSONWebKeySet
	if err := json.Unmarshal(b, &set); err != nil {
		return nil, fmt.Errorf("JWKS %s is not a JSON Web Key Set ({\"keys\":[…]}): %w", path, err)
	}
	if len(set.Keys) == 0 {
		return nil, fmt.Errorf("JWKS %s has no keys", path)
	}
	return &set, nil
}
