package idemgrpc_test

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/idemgrpc"
	"github.com/idemkit/idem/memstore"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/types/known/structpb"
)

// field encodes one field num of type typ with the payload (a length-delimited
// value's bytes, or an encoded varint).
func field(num protowire.Number, typ protowire.Type, payload []byte) []byte {
	b := protowire.AppendTag(nil, num, typ)
	if typ == protowire.BytesType {
		return protowire.AppendBytes(b, payload)
	}
	return append(b, payload...)
}

// sendTwice sends a, then b, under one key to a fresh server (cfg) and returns
// what the second call got and how often the method ran.
func sendTwice(t *testing.T, cfg *idemgrpc.Config, a, b []byte) (replayed bool, runs int64, err error) {
	t.Helper()
	if bytes.Equal(a, b) {
		t.Fatal("test setup: the two encodings must differ in bytes")
	}
	var n atomic.Int64
	create := func(ctx context.Context, in *structpb.Struct) (*structpb.Struct, error) {
		n.Add(1)
		return structpb.NewStruct(map[string]any{"ok": true})
	}
	cc := dial(t, serve(t, newServer(t, memstore.New(nil), cfg), &ordersService{create: create}))
	if _, err := invokeRaw(cc, createMethod, "k-canon", a); err != nil {
		t.Fatal(err)
	}
	replayed, err = invokeRaw(cc, createMethod, "k-canon", b)
	return replayed, n.Load(), err
}

// TestFingerprintTellsDifferentMessagesApart: unknown fields whose bytes differ
// in meaning are not made equal by the canonical order. Before, a nested
// payload's fields were sorted by number (a bytes value or packed list that
// happened to parse, e.g. packed [8 1 16 2] against [16 2 8 1], matched) and
// elements of a repeated message sharing a field 1 were sorted as map entries
// (a map has one entry per key).
func TestFingerprintTellsDifferentMessagesApart(t *testing.T) {
	t.Parallel()
	base := structValueEntry("cart", "c1")
	for name, c := range map[string][2][]byte{
		"packed list reordered": {
			concat(base, field(9, protowire.BytesType, []byte{8, 1, 16, 2})),
			concat(base, field(9, protowire.BytesType, []byte{16, 2, 8, 1}))},
		"repeated message sharing field 1 reordered": {
			concat(base, mapEntry(9, "sku", "1"), mapEntry(9, "sku", "2")),
			concat(base, mapEntry(9, "sku", "2"), mapEntry(9, "sku", "1"))},
		"packed against unpacked": {
			concat(base, field(9, protowire.BytesType, []byte{1, 2})),
			concat(base, field(9, protowire.VarintType, []byte{1}), field(9, protowire.VarintType, []byte{2}))},
		"repeated string reordered": {
			concat(base, field(9, protowire.BytesType, []byte("x")), field(9, protowire.BytesType, []byte("y"))),
			concat(base, field(9, protowire.BytesType, []byte("y")), field(9, protowire.BytesType, []byte("x")))},
		"repeated varint reordered": {
			concat(base, field(9, protowire.VarintType, []byte{1}), field(9, protowire.VarintType, []byte{2})),
			concat(base, field(9, protowire.VarintType, []byte{2}), field(9, protowire.VarintType, []byte{1}))},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rep, runs, err := sendTwice(t, nil, c[0], c[1])
			if status.Code(err) != codes.FailedPrecondition || rep || runs != 1 {
				t.Fatalf("a different message under the key: %v (replayed %v, %d runs); want FailedPrecondition", err, rep, runs)
			}
		})
	}
}

// TestFingerprintNestedUnknownMap: a message field the server does not know
// (9) holding a map (3) whose entries come in another order, next to a field
// (1) in number order: one message, the retry gets the replay.
func TestFingerprintNestedUnknownMap(t *testing.T) {
	t.Parallel()
	base := structValueEntry("cart", "c1")
	nested := func(entries ...[]byte) []byte {
		return concat(base, field(9, protowire.BytesType, concat(append([][]byte{field(1, protowire.BytesType, []byte("id-1"))}, entries...)...)))
	}
	a := nested(mapEntry(3, "a", "1"), mapEntry(3, "b", "2"), mapEntry(3, "c", "3"))
	b := nested(mapEntry(3, "c", "3"), mapEntry(3, "a", "1"), mapEntry(3, "b", "2"))
	rep, runs, err := sendTwice(t, nil, a, b)
	if err != nil || !rep || runs != 1 {
		t.Fatalf("the same nested map in another order: %v (replayed %v, %d runs); want the replay", err, rep, runs)
	}
}

// TestFingerprintUnknownMapNextToGroup: an unknown proto2 group (field 10)
// next to an unknown map (9) in another order: one message. Before, a group
// left every unknown field of the message as it came, and the retry was
// refused.
func TestFingerprintUnknownMapNextToGroup(t *testing.T) {
	t.Parallel()
	group := concat(protowire.AppendTag(nil, 10, protowire.StartGroupType), field(1, protowire.VarintType, []byte{7}), protowire.AppendTag(nil, 10, protowire.EndGroupType))
	base := structValueEntry("cart", "c1")
	a := concat(base, mapEntry(9, "a", "1"), mapEntry(9, "b", "2"), group)
	b := concat(base, mapEntry(9, "b", "2"), mapEntry(9, "a", "1"), group)
	rep, runs, err := sendTwice(t, nil, a, b)
	if err != nil || !rep || runs != 1 {
		t.Fatalf("the same map in another order next to a group: %v (replayed %v, %d runs); want the replay", err, rep, runs)
	}
	other := concat(base, mapEntry(9, "a", "1"), mapEntry(9, "b", "2"), concat(protowire.AppendTag(nil, 10, protowire.StartGroupType), field(1, protowire.VarintType, []byte{8}), protowire.AppendTag(nil, 10, protowire.EndGroupType)))
	if rep, _, err := sendTwice(t, nil, a, other); status.Code(err) != codes.FailedPrecondition || rep {
		t.Fatalf("another group value under the key: %v (replayed %v); want FailedPrecondition", err, rep)
	}
}

// TestKnownFieldsOnlyKeepsAnyOfUnknownType: with KnownFieldsOnly, the value of
// an Any whose type the server does not know is still the request's content:
// packed afresh (its map in another order) it gets the replay, another value
// is refused. Before, it was left verbatim and the retry was refused.
func TestKnownFieldsOnlyKeepsAnyOfUnknownType(t *testing.T) {
	t.Parallel()
	const url = "type.googleapis.com/idemtest.NotRegistered"
	inner := concat(structValueEntry("cart", "c1"), structValueEntry("note", "n"))
	innerSwapped := concat(structValueEntry("note", "n"), structValueEntry("cart", "c1"))
	innerOther := concat(structValueEntry("cart", "c2"), structValueEntry("note", "n"))
	svc := &anyService{}
	cc := dial(t, serveAnys(t, newServer(t, memstore.New(nil), &idemgrpc.Config{KnownFieldsOnly: true}), svc))
	if _, err := invokeRaw(cc, putMethod, "k-any", anyBytes(t, url, inner)); err != nil {
		t.Fatal(err)
	}
	if rep, err := invokeRaw(cc, putMethod, "k-any", anyBytes(t, url, innerSwapped)); err != nil || !rep || svc.n.Load() != 1 {
		t.Fatalf("the same Any packed afresh: %v (replayed %v), %d runs; want the replay", err, rep, svc.n.Load())
	}
	if _, err := invokeRaw(cc, putMethod, "k-any", anyBytes(t, url, innerOther)); status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("another value in the Any: %v; want FailedPrecondition", err)
	}
}
