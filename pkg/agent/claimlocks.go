package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"k8s.io/apimachinery/pkg/types"
)

// ErrClaimBusy is returned by Prepare and Unprepare when an earlier call
// for one of their claims has not finished by the time the caller gives
// up: its CDI spec generation has not returned (NVML may hang on a GPU in
// a bad state). The kubelet retries.
var ErrClaimBusy = errors.New("an earlier Prepare or Unprepare of the claim is still running")

// claimLocks is a set of per-claim locks whose waits end with a context.
// The zero value is ready to use.
type claimLocks struct {
	mutex sync.Mutex
	// held maps a locked claim to a channel closed when it is unlocked.
	held map[types.UID]chan struct{}
}

// lock takes the locks of uids, in UID order (so that two callers with
// overlapping claims never wait for each other in a cycle), waiting until
// each is free or ctx ends. It returns the function that unlocks them
// all; on error it holds none.
func (l *claimLocks) lock(ctx context.Context, uids []types.UID) (func(), error) {
	uids = slices.Clone(uids)
	slices.Sort(uids)
	uids = slices.Compact(uids)
	var taken []types.UID
	unlock := func() {
		l.mutex.Lock()
		defer l.mutex.Unlock()
		for _, uid := range taken {
			close(l.held[uid])
			delete(l.held, uid)
		}
	}
	for _, uid := range uids {
		for {
			l.mutex.Lock()
			if l.held == nil {
				l.held = map[types.UID]chan struct{}{}
			}
			busy, ok := l.held[uid]
			if !ok {
				l.held[uid] = make(chan struct{})
				l.mutex.Unlock()
				taken = append(taken, uid)
				break
			}
			l.mutex.Unlock()
			select {
			case <-busy:
			case <-ctx.Done():
				unlock()
				return nil, fmt.Errorf("claim %s: %w: %w", uid, ErrClaimBusy, context.Cause(ctx))
			}
		}
	}
	return unlock, nil
}

// tryLock takes the lock of uid if it is free.
func (l *claimLocks) tryLock(uid types.UID) (func(), bool) {
	l.mutex.Lock()
	defer l.mutex.Unlock()
	if _, busy := l.held[uid]; busy {
		return nil, false
	}
	if l.held == nil {
		l.held = map[types.UID]chan struct{}{}
	}
	done := make(chan struct{})
	l.held[uid] = done
	return func() {
		l.mutex.Lock()
		defer l.mutex.Unlock()
		close(done)
		delete(l.held, uid)
	}, true
}

// uidsOf returns the UID of each of objs.
func uidsOf[T any](objs []T, uid func(T) types.UID) []types.UID {
	uids := make([]types.UID, 0, len(objs))
	for _, o := range objs {
		uids = append(uids, uid(o))
	}
	return uids
}
