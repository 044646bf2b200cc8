package idemgrpc

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/protoadapt"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/durationpb"
)

// MetadataKey is the request metadata entry that carries the idempotency key.
const MetadataKey = "idempotency-key"

// ReplayedKey is the response header set to "true" on a replayed answer.
const ReplayedKey = "idempotent-replayed"

// PushbackKey is the trailer idem's answers that say when to retry carry
// (in flight, store unavailable): the milliseconds to wait, which grpc-go's
// built-in retry policy honours.
const PushbackKey = "grpc-retry-pushback-ms"

// ErrorDomain is the domain of the ErrorInfo detail on idem's own errors.
const ErrorDomain = "idem.idemkit.github.com"

// The media types of stored outcomes (the Content-Type of the in-process answer).
const (
	responseType = "application/x-protobuf"          // a response message; parameter messageType
	statusType   = "application/x-grpc-status+proto" // a google.rpc.Status
	problemType  = "application/problem+json"        // idem's own answer
)

// headerName is the header of the in-process request that carries the key.
const headerName = "Idempotency-Key"

var marshalOptions = proto.MarshalOptions{Deterministic: true}

// Config configures a Server. The zero value keys every unary call that carries
// a key, with idem's defaults.
type Config struct {
	// Idem configures the state machine: Lease, TTL, KeepFunc (see also
	// KeepCode), Flow, Observer,
	// ScopeFunc, MaxKeyLength, MaxRequestBody (the largest request message),
	// MaxStoredBody, HandlerTimeout, CleanupTimeout, NowFunc, LapsedLease.
	// HeaderName and Methods are set by idemgrpc (the key comes from MetadataKey);
	// Content-Type is always among StoredHeaders; ReplayFunc is not supported.
	// KeyOptional applies to the methods listed in Methods. Nil: idem's defaults.
	Idem *idem.Config

	// Methods lists the full method names ("/pkg.Service/Method") that are keyed;
	// a listed method called without a key is refused with InvalidArgument
	// (unless Idem.KeyOptional), other methods pass through. Empty: every unary
	// method called with a key is keyed, and calls without one pass through.
	Methods []string

	// Types finds the response message type of a replay by its full name, and
	// the type inside a google.protobuf.Any of a request (for its fingerprint).
	// Defaults to protoregistry.GlobalTypes, where generated code registers.
	Types protoregistry.MessageTypeResolver

	// Files finds the descriptors of the methods in Methods, so that NewServer
	// refuses a streaming one. Defaults to protoregistry.GlobalFiles. A method
	// it does not know is accepted; StreamInterceptor refuses it at call time.
	Files *protoregistry.Files

	// KnownFieldsOnly leaves the request's unknown fields (those of a client
	// built from a newer .proto) out of the fingerprint. By default they are in
	// it, in a canonical order (see the package documentation), so that the
	// same key with a different value of a field only the client knows is
	// refused.
	KnownFieldsOnly bool

	// KeepCode decides whether a handler's error status with code c is stored.
	// Defaults to DefaultKeepCode, which does not keep the codes that tell the
	// client to retry (Unavailable, ResourceExhausted, Aborted,
	// DeadlineExceeded, Canceled): the key is released and the retry runs the
	// method again. Idem.KeepFunc, when set, is asked too (by HTTPStatus); an
	// error status is stored only when both keep it.
	KeepCode func(c codes.Code) bool
}

// DefaultKeepCode is the default Config.KeepCode: it keeps every code but
// Unavailable, ResourceExhausted, Aborted, DeadlineExceeded and Canceled, the
// gRPC counterparts of HTTP 503, 429, 409 and 504 (and of a call cut short).
// Kept, they would answer every retry with "retry" for the record's TTL while
// the operation never runs again.
func DefaultKeepCode(c codes.Code) bool {
	switch c {
	case codes.Unavailable, codes.ResourceExhausted, codes.Aborted, codes.DeadlineExceeded, codes.Canceled:
		return false
	}
	return true
}

// Server holds a unary server interceptor built on one idem middleware.
type Server struct {
	h        http.Handler
	methods  map[string]bool // nil: every method with a key
	types    protoregistry.MessageTypeResolver
	canon    canonicalizer
	keepCode func(codes.Code) bool
}

// NewServer returns a Server keeping its records in store. A nil cfg means all
// defaults. It returns an error, saying what to change, when cfg is invalid.
func NewServer(store idem.Store, cfg *Config) (*Server, error) {
	if cfg == nil {
		cfg = &Config{}
	}
	var ic idem.Config
	if cfg.Idem != nil {
		ic = *cfg.Idem
	}
	if ic.ReplayFunc != nil {
		return nil, errors.New("idemgrpc: Config.Idem.ReplayFunc is not supported: a gRPC replay is the stored message or status; leave it nil")
	}
	ic.HeaderName = headerName
	ic.Methods = []string{http.MethodPost}
	if ic.StoredHeaders == nil {
		ic.StoredHeaders = idem.DefaultStoredHeaders
	}
	if !slices.ContainsFunc(ic.StoredHeaders, func(h string) bool { return strings.EqualFold(h, "Content-Type") }) {
		ic.StoredHeaders = append(slices.Clone(ic.StoredHeaders), "Content-Type")
	}
	mw, err := idem.New(store, &ic)
	if err != nil {
		return nil, fmt.Errorf("idemgrpc: %w", err)
	}
	s := &Server{types: cfg.Types, keepCode: cfg.KeepCode}
	if s.types == nil {
		s.types = protoregistry.GlobalTypes
	}
	if s.keepCode == nil {
		s.keepCode = DefaultKeepCode
	}
	s.canon = canonicalizer{types: s.types, dropUnknown: cfg.KnownFieldsOnly}
	files := cfg.Files
	if files == nil {
		files = protoregistry.GlobalFiles
	}
	if len(cfg.Methods) > 0 {
		s.methods = make(map[string]bool, len(cfg.Methods))
		for _, m := range cfg.Methods {
			if !strings.HasPrefix(m, "/") || strings.Count(m, "/") != 2 {
				return nil, fmt.Errorf("idemgrpc: method %q is not a full method name; write it as /package.Service/Method", m)
			}
			if streaming(files, m) {
				return nil, fmt.Errorf("idemgrpc: method %q in Config.Methods is a streaming method; idemgrpc keys unary methods only (a stream has no one request and response to fingerprint and replay): make the write a unary method, or remove it from Methods", m)
			}
			s.methods[m] = true
		}
	}
	s.h = mw(http.HandlerFunc(runHandler))
	return s, nil
}

// streaming reports whether files describes method (/pkg.Service/Method) as a
// client- or server-streaming method.
func streaming(files *protoregistry.Files, method string) bool {
	svc, name, _ := strings.Cut(method[1:], "/")
	d, err := files.FindDescriptorByName(protoreflect.FullName(svc))
	if err != nil {
		return false
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return false
	}
	md := sd.Methods().ByName(protoreflect.Name(name))
	return md != nil && (md.IsStreamingClient() || md.IsStreamingServer())
}

// StreamInterceptor returns a stream server interceptor that refuses, with
// Unimplemented, a stream idem would otherwise let through unprotected: a
// call of a method listed in Config.Methods (a streaming method NewServer did
// not know of), and, when Methods is empty, a stream that carries a key. A
// client that sends a key expects its write to run once; a stream cannot
// promise that. Other streams pass through. Chain it with
// grpc.ChainStreamInterceptor, after authentication.
func (s *Server) StreamInterceptor() grpc.StreamServerInterceptor {
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		md, _ := metadata.FromIncomingContext(ss.Context())
		if s.keyed(info.FullMethod, len(md.Get(MetadataKey)) > 0) {
			return status.Errorf(codes.Unimplemented, "idemgrpc: %s is a streaming method and idemgrpc keys unary methods only, so this call would run unprotected; call a unary method for the write, or (server) remove %s from idemgrpc.Config.Methods", info.FullMethod, info.FullMethod)
		}
		return handler(srv, ss)
	}
}

// UnaryInterceptor returns the unary server interceptor. Put the interceptor
// that authenticates the caller (and sets idem.WithScope) in front of it, for
// example with grpc.ChainUnaryInterceptor(auth, s.UnaryInterceptor()).
func (s *Server) UnaryInterceptor() grpc.UnaryServerInterceptor { return s.intercept }

// call is one keyed call on its way through the idem middleware.
type call struct {
	req      any
	handler  grpc.UnaryHandler
	keepCode func(codes.Code) bool
	ran      bool
	resp     any
	err      error
}

type callKey struct{}

func (s *Server) keyed(method string, hasKey bool) bool {
	if s.methods == nil {
		return hasKey
	}
	return s.methods[method]
}

func (s *Server) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	keys := md.Get(MetadataKey)
	if !s.keyed(info.FullMethod, len(keys) > 0) {
		return handler(ctx, req)
	}
	msg, ok := req.(proto.Message)
	if !ok {
		return nil, status.Errorf(codes.Internal, "idemgrpc: the request of %s is a %T, not a protobuf message; idemgrpc fingerprints protobuf requests only", info.FullMethod, req)
	}
	body, err := s.canon.fingerprintBytes(msg)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: the request of %s could not be encoded for its fingerprint: %v", info.FullMethod, err)
	}
	c := &call{req: req, handler: handler, keepCode: s.keepCode}
	r, err := http.NewRequestWithContext(context.WithValue(ctx, callKey{}, c), http.MethodPost, info.FullMethod, bytes.NewReader(body))
	if err != nil {
		return nil, status.Errorf(codes.Internal, "idemgrpc: method name %q: %v", info.FullMethod, err)
	}
	r.Proto, r.ProtoMajor, r.ProtoMinor = "HTTP/2.0", 2, 0
	// The call's metadata, as request headers: a custom Idem.ScopeFunc reads
	// them as it would an HTTP request's (binary "-bin" entries and pseudo
	// headers are left out).
	for k, vs := range md {
		if strings.HasPrefix(k, ":") || strings.HasSuffix(k, "-bin") {
			continue
		}
		for _, v := range vs {
			r.Header.Add(k, v)
		}
	}
	if len(keys) > 0 {
		r.Header[headerName] = keys
	}
	w := &responseWriter{header: make(http.Header, 4)}
	if released := serveCall(s.h, w, r); released {
		return nil, c.err // not kept (KeepCode): the key was released
	}
	return s.answer(ctx, c, w)
}

// notKept is the panic with which runHandler asks the idem middleware to
// release the key of a call whose error status is not kept: on a handler's
// panic the middleware rolls back and releases, and stores nothing.
type notKept struct{}

// serveCall serves r and reports whether the call's outcome was not kept.
func serveCall(h http.Handler, w http.ResponseWriter, r *http.Request) (released bool) {
	defer func() {
		if v := recover(); v != nil {
			if _, ok := v.(notKept); !ok {
				panic(v)
			}
			released = true
		}
	}()
	h.ServeHTTP(w, r)
	return false
}

// runHandler is the http.Handler idem runs for a claimed call: it calls the gRPC
// handler with the request's context (idem's execution context, which carries the
// store's transaction) and writes its outcome as protobuf.
func runHandler(w http.ResponseWriter, r *http.Request) {
	c := r.Context().Value(callKey{}).(*call)
	c.ran = true
	c.resp, c.err = c.handler(r.Context(), c.req)
	if c.err != nil {
		st := toStatus(c.err)
		if !c.keepCode(st.Code()) {
			panic(notKept{})
		}
		writeStatus(w, st)
		return
	}
	m, ok := c.resp.(proto.Message)
	if !ok {
		c.err = status.Errorf(codes.Internal, "idemgrpc: the handler returned a %T, not a protobuf message", c.resp)
		writeStatus(w, toStatus(c.err))
		return
	}
	b, err := marshalOptions.Marshal(m)
	if err != nil {
		c.err = status.Errorf(codes.Internal, "idemgrpc: the response could not be encoded for storage: %v", err)
		writeStatus(w, toStatus(c.err))
		return
	}
	w.Header().Set("Content-Type", mime.FormatMediaType(responseType, map[string]string{"messagetype": string(m.ProtoReflect().Descriptor().FullName())}))
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(b)
}

// toStatus is how grpc-go turns a handler's error into a status.
func toStatus(err error) *status.Status {
	if st, ok := status.FromError(err); ok {
		return st
	}
	return status.FromContextError(err)
}

func writeStatus(w http.ResponseWriter, st *status.Status) {
	b, err := marshalOptions.Marshal(st.Proto())
	if err != nil { // details that cannot be encoded: keep code and message
		b, _ = marshalOptions.Marshal(&spb.Status{Code: int32(st.Code()), Message: st.Message()})
	}
	w.Header().Set("Content-Type", statusType)
	w.WriteHeader(HTTPStatus(st.Code()))
	_, _ = w.Write(b)
}

// answer turns what the idem middleware wrote into the call's result.
func (s *Server) answer(ctx context.Context, c *call, w *responseWriter) (any, error) {
	replayed := w.header.Get(idem.ReplayedHeader) == "true"
	if replayed {
		_ = grpc.SetHeader(ctx, metadata.Pairs(ReplayedKey, "true"))
	}
	mt, params, _ := mime.ParseMediaType(w.header.Get("Content-Type"))
	switch mt {
	case responseType:
		if c.ran && !replayed && c.err == nil {
			return c.resp, nil
		}
		name := params["messagetype"]
		t, err := s.types.FindMessageByName(protoreflect.FullName(name))
		if err != nil {
			return nil, status.Errorf(codes.Internal, "idemgrpc: the stored response is a %s, a type this server does not know (%v); register it or set Config.Types", name, err)
		}
		m := t.New().Interface()
		if err := proto.Unmarshal(w.body.Bytes(), m); err != nil {
			return nil, status.Errorf(codes.Internal, "idemgrpc: the stored %s could not be decoded: %v", name, err)
		}
		return m, nil
	case statusType:
		if c.ran && !replayed && c.err != nil {
			return nil, c.err
		}
		var sp spb.Status
		if err := proto.Unmarshal(w.body.Bytes(), &sp); err != nil {
			return nil, status.Errorf(codes.Internal, "idemgrpc: the stored error status could not be decoded: %v", err)
		}
		return nil, status.ErrorProto(&sp)
	case problemType:
		err := problemError(w)
		if d, ok := RetryDelay(err); ok {
			// grpc-go's built-in retry waits this long before its next attempt
			// (when the code is among the policy's retryableStatusCodes) instead
			// of spending its attempts on a key still in use.
			_ = grpc.SetTrailer(ctx, metadata.Pairs(PushbackKey, strconv.FormatInt(d.Milliseconds(), 10)))
		}
		return nil, err
	}
	return nil, status.Errorf(codes.Internal, "idemgrpc: unexpected answer %d with Content-Type %q from the idem middleware", w.status, w.header.Get("Content-Type"))
}

// problemCodes maps idem's problem codes to gRPC codes.
var problemCodes = map[string]codes.Code{
	idem.CodeKeyMissing:       codes.InvalidArgument,
	idem.CodeKeyInvalid:       codes.InvalidArgument,
	idem.CodeBodyUnreadable:   codes.InvalidArgument,
	idem.CodeKeyInUse:         codes.Aborted,
	idem.CodeLeaseLost:        codes.Aborted,
	idem.CodeKeyReused:        codes.FailedPrecondition,
	idem.CodeBodyTooLarge:     codes.ResourceExhausted,
	idem.CodeStoreUnavailable: codes.Unavailable,
	idem.CodeCommitFailed:     codes.Unavailable,
	idem.CodeTxAborted:        codes.Aborted,
	idem.CodeOutcomeUnknown:   codes.FailedPrecondition,
	idem.CodeResponseTooLarge: codes.Internal,
	idem.CodeReplayFailed:     codes.Internal,
}

// problemError turns idem's problem answer into a status error with an
// ErrorInfo detail and, when the answer had a Retry-After, a RetryInfo detail.
func problemError(w *responseWriter) error {
	var p idem.Problem
	_ = json.Unmarshal(w.body.Bytes(), &p)
	if p.Status == 0 {
		p.Status = w.status
	}
	code, ok := problemCodes[p.Code]
	if !ok {
		code = codeForHTTP(p.Status)
	}
	msg := p.Detail
	if msg == "" {
		msg = p.Title
	}
	st := status.New(code, msg)
	info := &errdetails.ErrorInfo{Reason: strings.ToUpper(p.Code), Domain: ErrorDomain}
	details := []protoadapt.MessageV1{info}
	if secs, err := strconv.Atoi(w.header.Get("Retry-After")); err == nil && secs > 0 {
		details = append(details, &errdetails.RetryInfo{RetryDelay: durationpb.New(time.Duration(secs) * time.Second)})
	}
	if withDetails, err := st.WithDetails(details...); err == nil {
		st = withDetails
	}
	return st.Err()
}

func codeForHTTP(s int) codes.Code {
	switch {
	case s == http.StatusConflict:
		return codes.Aborted
	case s == http.StatusUnprocessableEntity:
		return codes.FailedPrecondition
	case s == http.StatusServiceUnavailable:
		return codes.Unavailable
	case s >= 400 && s < 500:
		return codes.InvalidArgument
	}
	return codes.Internal
}

// HTTPStatus is the HTTP status under which a handler's error with code c is
// stored, and so what idem.Config.KeepFunc is asked about: the mapping of
// google.api's HTTP rules (Unavailable 503, Internal 500, InvalidArgument 400, …).
func HTTPStatus(c codes.Code) int {
	switch c {
	case codes.OK:
		return http.StatusOK
	case codes.Canceled:
		return 499
	case codes.InvalidArgument, codes.FailedPrecondition, codes.OutOfRange:
		return http.StatusBadRequest
	case codes.DeadlineExceeded:
		return http.StatusGatewayTimeout
	case codes.NotFound:
		return http.StatusNotFound
	case codes.AlreadyExists, codes.Aborted:
		return http.StatusConflict
	case codes.PermissionDenied:
		return http.StatusForbidden
	case codes.Unauthenticated:
		return http.StatusUnauthorized
	case codes.ResourceExhausted:
		return http.StatusTooManyRequests
	case codes.Unimplemented:
		return http.StatusNotImplemented
	case codes.Unavailable:
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError // Unknown, Internal, DataLoss
}

// responseWriter is the in-memory http.ResponseWriter the idem middleware answers
// a call into.
type responseWriter struct {
	header http.Header
	status int
	body   bytes.Buffer
}

func (w *responseWriter) Header() http.Header { return w.header }

func (w *responseWriter) WriteHeader(status int) {
	if w.status == 0 {
		w.status = status
	}
}

func (w *responseWriter) Write(p []byte) (int, error) {
	if w.status == 0 {
		w.status = http.StatusOK
	}
	return w.body.Write(p)
}
