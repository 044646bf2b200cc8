package idem

import "sync"

var joins sync.Map // key → chan struct{}

func init() {
	waitJoined = func(key string) {
		if ch, ok := joins.Load(key); ok {
			ch.(chan struct{}) <- struct{}{}
		}
	}
}

// WaitJoins returns a channel that receives once for each request with key
// that starts waiting for its holder's outcome.
func WaitJoins(key string) <-chan struct{} {
	ch := make(chan struct{}, 10000)
	joins.Store(key, ch)
	return ch
}
