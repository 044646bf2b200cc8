// Package wakehub fans notifications about keys out to the watchers of this
// process: the in-process half of a store's idem.OutcomeNotifier.
package wakehub

import (
	"crypto/sha256"
	"encoding/hex"
	"sync"
)

// Hub delivers Notify(id) to every Watch(id) of the process. Its zero value is
// ready to use; it is safe for concurrent use.
type Hub struct {
	mu   sync.Mutex
	subs map[string]map[chan struct{}]struct{}
}

// Watch returns a channel that receives (without the sender blocking: a
// buffer of one) after each Notify of id from now on, and the function that
// ends the watch.
func (h *Hub) Watch(id string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	h.mu.Lock()
	if h.subs == nil {
		h.subs = make(map[string]map[chan struct{}]struct{})
	}
	set := h.subs[id]
	if set == nil {
		set = make(map[chan struct{}]struct{}, 1)
		h.subs[id] = set
	}
	set[ch] = struct{}{}
	h.mu.Unlock()
	var once sync.Once
	return ch, func() {
		once.Do(func() {
			h.mu.Lock()
			defer h.mu.Unlock()
			delete(set, ch)
			if len(set) == 0 && h.subs[id] != nil && len(h.subs[id]) == 0 {
				delete(h.subs, id)
			}
		})
	}
}

// Notify wakes the watchers of id.
func (h *Hub) Notify(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for ch := range h.subs[id] {
		wake(ch)
	}
}

// NotifyAll wakes every watcher: notifications may have been lost (a
// reconnect), so each reads its key again.
func (h *Hub) NotifyAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, set := range h.subs {
		for ch := range set {
			wake(ch)
		}
	}
}

// Len returns the number of watches open.
func (h *Hub) Len() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	n := 0
	for _, set := range h.subs {
		n += len(set)
	}
	return n
}

func wake(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// ID names (scope, key) in a notification: 32 hex digits of a SHA-256 of
// both, short and free of any byte a channel payload could not carry, and
// saying nothing of the key to whoever reads the channel.
func ID(scope, key string) string {
	h := sha256.New()
	h.Write([]byte(scope))
	h.Write([]byte{0})
	h.Write([]byte(key))
	var sum [sha256.Size]byte
	return hex.EncodeToString(h.Sum(sum[:0])[:16])
}
