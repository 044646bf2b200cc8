// Package clienttest helps test retrying clients against an idem server over real
// sockets. Its Proxy loses answers the way networks do: the request reaches the
// server, the server carries it out and starts answering, and the connection to
// the client is reset before the answer gets there. A client that retries such an
// operation without the same idempotency key executes it twice; one that keeps its
// key gets a replay.
//
// # Limits
//
// The proxy listens on 127.0.0.1 only and speaks TCP, not HTTP: it cannot tell
// requests apart on a keep-alive connection, so a lossy connection loses the
// answer to its first request and dies with it. Use a client transport with
// DisableKeepAlives to make every attempt a connection of its own, which also keeps
// net/http from re-sending keyed requests by itself. Plain TCP only (no TLS
// termination, no HTTP/2 over TLS).
package clienttest
