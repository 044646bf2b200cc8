package main

import (
	"bytes"
	"compress/gzip"
	"encoding/binary"
	"io"
	"net/http"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
)

// entry encodes one entry of Struct.fields: key → value.
func entry(t *testing.T, key string, v *structpb.Value) []byte {
	t.Helper()
	vb, err := proto.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	e := protowire.AppendTag(nil, 1, protowire.BytesType)
	e = protowire.AppendString(e, key)
	e = protowire.AppendTag(e, 2, protowire.BytesType)
	e = protowire.AppendBytes(e, vb)
	b := protowire.AppendTag(nil, 1, protowire.BytesType)
	return protowire.AppendBytes(b, e)
}

// post sends body with Content-Type ct under key and returns the status, the
// Idempotent-Replayed header and the answer.
func post(t *testing.T, url, ct, key string, body []byte) (int, string, []byte) {
	t.Helper()
	req, _ := http.NewRequest("POST", url+CreateOrderProcedure, bytes.NewReader(body))
	if base, ok := strings.CutSuffix(ct, "+gzip"); ok {
		ct = base
		if strings.HasPrefix(ct, "application/grpc-web") {
			req.Header.Set("Grpc-Encoding", "gzip")
		} else {
			req.Header.Set("Content-Encoding", "gzip")
		}
	}
	req.Header.Set("Content-Type", ct)
	req.Header.Set("Authorization", "Bearer t1")
	req.Header.Set("Idempotency-Key", key)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header.Get("Idempotent-Replayed"), b
}

func gzipped(b []byte) []byte {
	var buf bytes.Buffer
	zw := gzip.NewWriter(&buf)
	_, _ = zw.Write(b)
	_ = zw.Close()
	return buf.Bytes()
}

func frame(msg []byte) []byte {
	return append(binary.BigEndian.AppendUint32([]byte{0}, uint32(len(msg))), msg...)
}

// TestProtoRetryInOtherBytes: connect-go's default binary codec encodes the
// Struct's map in a new order on every attempt. A retry of one message in
// other bytes (Connect protocol and gRPC-Web, uncompressed and gzip) gets the replay, and the order
// is placed once; before, it was refused 422 as another request. The same
// key with another message, or the same message in JSON, is still refused.
func TestProtoRetryInOtherBytes(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		ct   string
		wrap func([]byte) []byte
	}{
		{"application/proto", func(b []byte) []byte { return b }},
		{"application/grpc-web+proto", frame},
		{"application/proto+gzip", gzipped},
		{"application/grpc-web+proto+gzip", func(b []byte) []byte { g := frame(gzipped(b)); g[0] = 1; return g }},
	} {
		t.Run(tc.ct, func(t *testing.T) {
			t.Parallel()
			srv, orders := startOrders(t)
			cart, total := entry(t, "cart_id", structpb.NewStringValue("c_bytes")), entry(t, "total_cents", structpb.NewNumberValue(1900))
			a, b := append(append([]byte{}, cart...), total...), append(append([]byte{}, total...), cart...)
			var ma, mb structpb.Struct
			if proto.Unmarshal(a, &ma) != nil || proto.Unmarshal(b, &mb) != nil || !proto.Equal(&ma, &mb) || bytes.Equal(a, b) {
				t.Fatal("test setup: one message in two encodings")
			}
			s1, _, body1 := post(t, srv.URL, tc.ct, "k-bytes", tc.wrap(a))
			s2, rep, body2 := post(t, srv.URL, tc.ct, "k-bytes", tc.wrap(b))
			if s1 != 200 || s2 != 200 || rep != "true" || !bytes.Equal(body1, body2) || len(orders.List("t1", "c_bytes")) != 1 {
				t.Fatalf("one message in other bytes: %d then %d (replayed %q), %d orders; want the replay of one order", s1, s2, rep, len(orders.List("t1", "c_bytes")))
			}
			other := append(append([]byte{}, cart...), entry(t, "total_cents", structpb.NewNumberValue(1))...)
			if s, _, _ := post(t, srv.URL, tc.ct, "k-bytes", tc.wrap(other)); s != http.StatusUnprocessableEntity {
				t.Fatalf("another message under the key: %d; want 422", s)
			}
			if s, _, _ := post(t, srv.URL, "application/json", "k-bytes", []byte(`{"cart_id":"c_bytes","total_cents":1900}`)); s != http.StatusUnprocessableEntity {
				t.Fatalf("the same message in JSON under the key: %d; want 422 (never the protobuf answer)", s)
			}
		})
	}
}

// TestJSONRetryInOtherBytes: one JSON message with its keys in another order
// and other spacing (another client build, a client that rebuilt its object)
// gets the replay; another value is refused.
func TestJSONRetryInOtherBytes(t *testing.T) {
	t.Parallel()
	srv, orders := startOrders(t)
	s1, _, body1 := post(t, srv.URL, "application/json", "k-json", []byte(`{"cart_id":"c_json","total_cents":1900}`))
	s2, rep, body2 := post(t, srv.URL, "application/json", "k-json", []byte(`{ "total_cents": 1900,  "cart_id": "c_json" }`))
	if s1 != 200 || s2 != 200 || rep != "true" || !bytes.Equal(body1, body2) || len(orders.List("t1", "c_json")) != 1 {
		t.Fatalf("one JSON message in other bytes: %d then %d (replayed %q), %d orders; want the replay of one order", s1, s2, rep, len(orders.List("t1", "c_json")))
	}
	if s, _, _ := post(t, srv.URL, "application/json", "k-json", []byte(`{"cart_id":"c_json","total_cents":1}`)); s != http.StatusUnprocessableEntity {
		t.Fatalf("another JSON message under the key: %d; want 422", s)
	}
}
