package topologydra

import "sync"

// eventMemo remembers a pod-independent answer about the latest event's
// pair of objects. The scheduling queue asks a queueing hint once per
// waiting pod with the same old and new objects of an event, under its
// lock; what does not depend on the pod is computed once per event. The
// objects are told apart by identity: informers hand out a new object for
// every change and do not modify them. The zero value is ready; safe for
// concurrent use.
type eventMemo[T any] struct {
	mu       sync.Mutex
	old, new *T
	answer   bool
	set      bool
}

// get returns compute's answer for (old, new), computing it only where the
// pair differs from the one asked last; nil objects are never remembered.
func (m *eventMemo[T]) get(old, new *T, compute func() bool) bool {
	if old == nil || new == nil {
		return compute()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.set && m.old == old && m.new == new {
		return m.answer
	}
	m.answer = compute()
	m.old, m.new, m.set = old, new, true
	return m.answer
}
