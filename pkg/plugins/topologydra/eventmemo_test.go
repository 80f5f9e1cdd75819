package topologydra

import (
	"fmt"
	"testing"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	fwk "k8s.io/kube-scheduler/framework"
)

// TestEventMemo: an answer is computed once per pair of objects and again
// for another pair, by identity, not by content; nil objects are never
// remembered.
func TestEventMemo(t *testing.T) {
	var m eventMemo[v1.Node]
	calls := 0
	compute := func(answer bool) func() bool {
		return func() bool { calls++; return answer }
	}
	a, b := &v1.Node{}, &v1.Node{}
	for range 3 {
		if !m.get(a, b, compute(true)) {
			t.Error("answer for (a, b) lost")
		}
	}
	if calls != 1 {
		t.Errorf("%d computations for one pair asked three times, want 1", calls)
	}
	same := *b
	if m.get(a, &same, compute(false)) || calls != 2 {
		t.Errorf("a pair of other objects with the same content got the remembered answer (%d computations)", calls)
	}
	m.get(nil, b, compute(true))
	m.get(nil, b, compute(true))
	if calls != 4 {
		t.Errorf("%d computations, want 4: nil objects are not remembered", calls)
	}
}

// BenchmarkSliceHintPerEvent asks the slice-update hint for 1,000 waiting
// pods about one update of an 8-GPU slice that changes only its metadata,
// as the scheduling queue does for one event.
func BenchmarkSliceHintPerEvent(b *testing.B) {
	var devices []resourceapi.Device
	for i := range 8 {
		devices = append(devices, resourceapi.Device{Name: fmt.Sprintf("gpu-%d", i), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"model": {StringValue: ptrTo("h100")}, "numaNode": {IntValue: ptrTo(int64(i / 4))}, "pcieRoot": {StringValue: ptrTo(fmt.Sprintf("pci0000:%02x", i))},
		}})
	}
	pods := make([]*v1.Pod, 1000)
	for i := range pods {
		pods[i] = &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("p%d", i)}}
	}
	logger := klog.Background()
	for b.Loop() {
		pl := &TopologyDRA{}
		old := &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: "s", ResourceVersion: "1"}, Spec: resourceapi.ResourceSliceSpec{Driver: "d", Devices: devices}}
		updated := old.DeepCopy()
		updated.ResourceVersion = "2"
		for _, pod := range pods {
			if hint, _ := pl.isSchedulableAfterSliceChange(logger, pod, old, updated); hint != fwk.QueueSkip {
				b.Fatal("metadata-only update requeued a pod")
			}
		}
	}
}

func ptrTo[T any](v T) *T { return &v }
