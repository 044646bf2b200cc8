package idemgrpc

import (
	"bytes"
	"slices"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/known/anypb"
)

// The fingerprint of a request message is its canonical encoding: the
// deterministic encoding of a copy in which what the server cannot sort by its
// schema is put in one order too. grpc-go's codec (and anypb.New) encode maps
// in no fixed order; the server's own maps are sorted by Deterministic, but
// two kinds of bytes are copied verbatim and would make one message look like
// two:
//
//   - unknown fields (a client built from a newer .proto, during every rolling
//     upgrade): they are grouped by field number, in number order (the order
//     of different fields carries no meaning: proto.Equal ignores it), and an
//     unknown length-delimited field whose every occurrence is shaped like a map
//     entry (fields 1 and 2 only, no key twice) has its entries sorted. A
//     payload that parses as a message has its runs of map entries sorted the
//     same way, recursively, but its fields keep their order (encoders write
//     a message's fields in number order; a bytes value or packed list that
//     happens to parse must not be re-sorted).
//   - the value of a google.protobuf.Any: decoded with Config.Types when its
//     type is known there and canonicalised as a message, otherwise treated as
//     unknown fields (kept with KnownFieldsOnly: it is the request's content).
//
// The cost of the map-entry rule: an unknown repeated message field of two
// fields numbered 1 and 2, with distinct field-1 values, whose elements come
// in another order fingerprints the same. Config.KnownFieldsOnly leaves
// unknown fields out altogether.

// maxCanonicalDepth bounds the recursion into nested unknown payloads.
const maxCanonicalDepth = 32

type canonicalizer struct {
	types        protoregistry.MessageTypeResolver
	dropUnknown  bool
	unmarshalAny proto.UnmarshalOptions
}

// fingerprintBytes returns the canonical encoding of msg.
func (c *canonicalizer) fingerprintBytes(msg proto.Message) ([]byte, error) {
	m := proto.Clone(msg)
	c.message(m.ProtoReflect(), 0)
	return marshalOptions.Marshal(m)
}

func (c *canonicalizer) message(m protoreflect.Message, depth int) {
	if depth > maxCanonicalDepth || !m.IsValid() {
		return
	}
	if m.Descriptor().FullName() == "google.protobuf.Any" {
		c.anyValue(m, depth)
	}
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsMap():
			if fd.MapValue().Message() != nil {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					c.message(mv.Message(), depth+1)
					return true
				})
			}
		case fd.IsList():
			if fd.Message() != nil {
				l := v.List()
				for i := range l.Len() {
					c.message(l.Get(i).Message(), depth+1)
				}
			}
		case fd.Message() != nil:
			c.message(v.Message(), depth+1)
		}
		return true
	})
	if u := m.GetUnknown(); len(u) > 0 {
		if c.dropUnknown {
			m.SetUnknown(nil)
		} else {
			m.SetUnknown(canonicalRaw(u, depth, true))
		}
	}
}

// anyValue replaces the value of m, a google.protobuf.Any, with its canonical
// encoding.
func (c *canonicalizer) anyValue(m protoreflect.Message, depth int) {
	a, ok := m.Interface().(*anypb.Any)
	if !ok || len(a.GetValue()) == 0 {
		return
	}
	if t, err := c.types.FindMessageByURL(a.GetTypeUrl()); err == nil {
		inner := t.New().Interface()
		if c.unmarshalAny.Unmarshal(a.GetValue(), inner) == nil {
			c.message(inner.ProtoReflect(), depth+1)
			if b, err := marshalOptions.Marshal(inner); err == nil {
				a.Value = b
				return
			}
		}
	}
	// A type the server does not know: its value is the message itself, not
	// unknown fields of the request, so it is canonicalised (never dropped)
	// even with KnownFieldsOnly.
	a.Value = canonicalRaw(a.GetValue(), depth+1, true)
}

type rawField struct {
	num  protowire.Number
	typ  protowire.Type
	body []byte // the field's whole encoding: tag and value
	val  []byte // a length-delimited field's payload
}

// canonicalRaw returns b, a run of encoded fields, in the canonical order
// described above; b itself when it does not parse. top says that b is known to
// be a message (the unknown fields of a decoded message, the value of an Any):
// its fields are grouped by number. A nested payload may as well be a string,
// bytes or a packed list that happens to parse: encoders write a message's
// fields in number order, so its fields keep their order and only runs of
// adjacent map entries are sorted.
func canonicalRaw(b []byte, depth int, top bool) []byte {
	fields, ok := parseRaw(b)
	if !ok || depth > maxCanonicalDepth {
		return b
	}
	for i, f := range fields {
		if f.typ == protowire.BytesType {
			if inner, ok := parseRaw(f.val); ok && len(inner) > 0 {
				fields[i] = bytesField(f.num, canonicalRaw(f.val, depth+1, false))
			}
		}
	}
	if top {
		slices.SortStableFunc(fields, func(a, b rawField) int { return int(a.num) - int(b.num) })
	}
	for i := 0; i < len(fields); {
		j := i
		for j < len(fields) && fields[j].num == fields[i].num {
			j++
		}
		if run := fields[i:j]; j-i > 1 && allMapEntries(run) {
			slices.SortStableFunc(run, func(a, b rawField) int { return bytes.Compare(a.body, b.body) })
		}
		i = j
	}
	out := make([]byte, 0, len(b))
	for _, f := range fields {
		out = append(out, f.body...)
	}
	return out
}

func bytesField(num protowire.Number, val []byte) rawField {
	body := protowire.AppendTag(nil, num, protowire.BytesType)
	body = protowire.AppendBytes(body, val)
	return rawField{num: num, typ: protowire.BytesType, body: body, val: body[len(body)-len(val):]}
}

func parseRaw(b []byte) ([]rawField, bool) {
	var fields []rawField
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeField(b)
		if n < 0 || typ == protowire.EndGroupType {
			return nil, false // malformed: left as it came
		}
		// A group (proto2) is one field, kept whole as it came.
		f := rawField{num: num, typ: typ, body: b[:n]}
		if typ == protowire.BytesType {
			_, _, tn := protowire.ConsumeTag(b)
			v, _ := protowire.ConsumeBytes(b[tn:])
			f.val = v
		}
		fields = append(fields, f)
		b = b[n:]
	}
	return fields, true
}

// allMapEntries reports whether run has the shape of a map's entries: every
// field length-delimited with a payload of fields 1 (key) and 2 (value) only,
// each at most once, and no key twice (a map has one entry per key, so a
// repeated message whose elements share a field 1 is not taken for one).
func allMapEntries(run []rawField) bool {
	keys := make(map[string]bool, len(run))
	for _, f := range run {
		if f.typ != protowire.BytesType {
			return false
		}
		inner, ok := parseRaw(f.val)
		if !ok {
			return false
		}
		var seen [3]bool
		var key []byte
		for _, e := range inner {
			if (e.num != 1 && e.num != 2) || seen[e.num] {
				return false
			}
			seen[e.num] = true
			if e.num == 1 {
				key = e.body
			}
		}
		if keys[string(key)] {
			return false
		}
		keys[string(key)] = true
	}
	return true
}
