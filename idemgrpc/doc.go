// Package idemgrpc gives unary gRPC methods the Idempotency-Key contract of
// package idem: a retried call with the same key runs the method once, and every
// retry gets the outcome of that one execution.
//
// The server interceptor (NewServer, then Server.UnaryInterceptor) reuses idem's
// own state machine — the same stores, states, leases, fencing, TTL and
// transactional completion as the HTTP middleware — by handing each keyed call to
// an idem middleware as an in-process request: method POST, path the full gRPC
// method name, body the request message's canonical protobuf encoding, the
// key from the "idempotency-key" metadata entry, the call's metadata as headers
// (for a custom idem.Config.ScopeFunc) and the call's context (so the scope is
// what an authentication interceptor in front stored with idem.WithScope). The
// fingerprint is therefore the full method name and the request message; the
// same key with another message is refused.
//
// The canonical encoding is what the message means, not the bytes a client's
// codec chose: maps are sorted, unknown fields (from a client built from a
// newer .proto) are put in field-number order with the entries of an unknown
// map sorted, and the value of a google.protobuf.Any is decoded (with
// Config.Types) and re-encoded the same way, so that a retry of one message
// encoded afresh is a retry, not a key reuse. Config.KnownFieldsOnly leaves
// unknown fields out of the fingerprint (not the value of an Any of a type
// the server does not know). See docs/grpc.md for what is told apart.
//
// The method's handler runs with the context idem gives a claimed request: the
// call's values, not the client's cancellation, ending at idem.Config's
// HandlerTimeout or when the lease is lost. With a SQL store the handler does its
// writes in the transaction idem opened (pgstore.Tx(ctx), sqlitestore.Tx(ctx)),
// and the stored outcome commits with them.
//
// What is stored and replayed is the response message, or the error status with
// its details. A replay answers with a new message decoded from the stored bytes
// and sets the response header "idempotent-replayed: true". Header and trailer
// metadata the handler set are not stored: a replay carries only that header.
//
// idem's own answers map to gRPC status codes:
//
//	missing or invalid key          InvalidArgument
//	in flight (key in use)          Aborted, with a RetryInfo detail (the lease left)
//	lease lost to a takeover        Aborted, with a RetryInfo detail
//	key reused with another message FailedPrecondition, ErrorInfo reason IDEMPOTENCY_KEY_REUSED
//	request message too large       ResourceExhausted
//	store unreachable               Unavailable, with a RetryInfo detail
//	commit failed or unconfirmed    Unavailable
//	transaction rolled back         Aborted
//	outcome unknown (LapsedRefuse)  FailedPrecondition
//	response too large to keep      Internal
//
// Each of these carries an ErrorInfo detail whose reason is idem's problem code
// in upper case (IDEMPOTENCY_KEY_IN_USE, …) and whose domain is ErrorDomain.
//
// A handler's error status is stored unless Config.KeepCode says otherwise:
// by default (DefaultKeepCode) Unavailable, ResourceExhausted, Aborted,
// DeadlineExceeded and Canceled are not kept — they tell the client to retry,
// and the key is released so that the retry runs the method again. The status
// is also asked of idem.Config.KeepFunc, when set, under the HTTP status of its
// code (HTTPStatus): KeepFunc returning false for 5xx releases the key after
// Internal errors too.
//
// The in-flight answer (Aborted) and the store-unavailable answer carry the
// trailer grpc-retry-pushback-ms (PushbackKey) with their RetryInfo delay:
// grpc-go's built-in retry policy waits that long before its next attempt.
//
// The client interceptor (UnaryClientInterceptor) makes one key per call, before
// its first attempt, and sends it with every attempt of that call: gRPC's own
// retry policy (service config) and retry interceptors placed after it resend the
// same metadata.
//
// Streaming RPCs are out of scope. A stream has no single request and response
// to fingerprint and replay; make the write a unary method, or key the
// stream's messages yourself. NewServer refuses a streaming method listed in
// Config.Methods (found in Config.Files), and Server.StreamInterceptor refuses
// the stream calls idem would otherwise let through unprotected: those of a
// listed method, and, with Methods empty, those that carry a key.
package idemgrpc
