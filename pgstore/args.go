package pgstore

import (
	"time"
	"unsafe"

	"github.com/jackc/pgx/v5/pgtype"
)

// Statement parameters that pgx encodes without allocating. A value put into an
// `any` allocates unless it is a pointer (or a small integer or bool), and pgx
// wraps a time.Time in one more interface value before encoding it; a pointer
// to one of these types, kept in a struct the request allocated anyway, costs
// neither: pgx finds the valuer interface it encodes from directly. Per
// first-time request that saves about twenty allocations.

// byteaArg is a bytea parameter taken from a string without copying it (pgx
// copies the bytes into its buffer). The empty string is an empty value, not
// NULL.
type byteaArg string

var emptyBytes = []byte{}

func (a *byteaArg) BytesValue() ([]byte, error) {
	if len(*a) == 0 {
		return emptyBytes, nil
	}
	return unsafe.Slice(unsafe.StringData(string(*a)), len(*a)), nil
}

// bytesArg is a bytea parameter; nil is NULL.
type bytesArg []byte

func (a *bytesArg) BytesValue() ([]byte, error) { return *a, nil }

// textArg is a text parameter.
type textArg string

func (a *textArg) TextValue() (pgtype.Text, error) {
	return pgtype.Text{String: string(*a), Valid: true}, nil
}

// tsArg is a timestamptz parameter.
type tsArg time.Time

func (a *tsArg) TimestamptzValue() (pgtype.Timestamptz, error) {
	return pgtype.Timestamptz{Time: time.Time(*a), Valid: true}, nil
}

// int8Arg is a bigint parameter.
type int8Arg int64

func (a *int8Arg) Int64Value() (pgtype.Int8, error) {
	return pgtype.Int8{Int64: int64(*a), Valid: true}, nil
}

// int4Arg is a nullable integer parameter.
type int4Arg struct {
	v     int32
	valid bool
}

func (a *int4Arg) Int64Value() (pgtype.Int8, error) {
	return pgtype.Int8{Int64: int64(a.v), Valid: a.valid}, nil
}
