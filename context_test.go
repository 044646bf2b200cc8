package idem

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// The handler's context makes its cancel context on first use; an end before
// that use must look exactly like an end after it.
func TestExecContextEndsBeforeAndAfterFirstUse(t *testing.T) {
	type key struct{}
	values := context.WithValue(context.Background(), key{}, "v")
	for _, tc := range []struct {
		name    string
		cause   error
		wantErr error
	}{
		{"lease lost", ErrLockLost, context.Canceled},
		{"deadline", context.DeadlineExceeded, context.DeadlineExceeded},
		{"request over", nil, context.Canceled},
	} {
		for _, usedFirst := range []bool{false, true} {
			var c execContext
			c.init(values, time.Time{}, nil)
			var child context.Context
			if usedFirst {
				var cancel context.CancelFunc
				child, cancel = context.WithTimeout(&c, time.Hour)
				defer cancel()
			}
			if c.Err() != nil {
				t.Fatalf("%s: Err before the end = %v", tc.name, c.Err())
			}
			c.end(tc.cause)
			c.end(errors.New("a later cause")) // the first cause stays
			if got := c.Err(); got != tc.wantErr {
				t.Errorf("%s (used first %v): Err = %v, want %v", tc.name, usedFirst, got, tc.wantErr)
			}
			select {
			case <-c.Done():
			default:
				t.Errorf("%s (used first %v): Done is not closed", tc.name, usedFirst)
			}
			wantCause := tc.cause
			if wantCause == nil {
				wantCause = context.Canceled
			}
			if got := context.Cause(&c); !errors.Is(got, wantCause) {
				t.Errorf("%s (used first %v): Cause = %v, want %v", tc.name, usedFirst, got, wantCause)
			}
			if got := c.lockLost(); got != (tc.cause == ErrLockLost) {
				t.Errorf("%s (used first %v): lockLost = %v", tc.name, usedFirst, got)
			}
			if c.Value(key{}) != "v" {
				t.Errorf("%s: the request's values are lost", tc.name)
			}
			if child == nil {
				var cancel context.CancelFunc
				child, cancel = context.WithCancel(&c)
				defer cancel()
			}
			select {
			case <-child.Done():
			case <-time.After(5 * time.Second):
				t.Errorf("%s (used first %v): a derived context did not end", tc.name, usedFirst)
			}
		}
	}
}

// The handler's context made on first use by many goroutines at once, while
// the lease is lost: every goroutine gets the same Done channel, and all see
// the end with its cause.
func TestExecContextConcurrentFirstUse(t *testing.T) {
	for round := range 200 {
		var c execContext
		c.init(context.Background(), time.Time{}, nil)
		const n = 8
		start := make(chan struct{})
		dones := make([]<-chan struct{}, n)
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				<-start
				switch i % 4 {
				case 0:
					_ = c.Err()
				case 1:
					_ = c.Value(recorderKey{})
					_ = c.Value(struct{}{})
				case 2:
					child, cancel := context.WithCancel(&c)
					defer cancel()
					<-child.Done()
				}
				dones[i] = c.Done()
			})
		}
		wg.Go(func() {
			<-start
			c.end(ErrLockLost)
		})
		close(start)
		wg.Wait()
		for i, d := range dones {
			if d != dones[0] {
				t.Fatalf("round %d: goroutine %d got another Done channel", round, i)
			}
			select {
			case <-d:
			default:
				t.Fatalf("round %d: Done not closed after the end", round)
			}
		}
		if c.Err() != context.Canceled || !errors.Is(context.Cause(&c), ErrLockLost) || !c.lockLost() {
			t.Fatalf("round %d: Err %v, Cause %v, lockLost %v", round, c.Err(), context.Cause(&c), c.lockLost())
		}
	}
}
