package agent

import (
	"strings"
	"testing"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// TestClearFaultsTimeLimit: the time of a ClearFaultsAnnotation may not be
// after the moment the annotation was set, as the Node's managed fields
// record it (the entry that owns the key), so that a value set ahead of
// its time stays refused once that time has passed, after an agent
// restart too; without such an entry the agent's clock decides.
func TestClearFaultsTimeLimit(t *testing.T) {
	now := time.Now().Truncate(time.Second)
	entry := func(manager string, at time.Time, fields string) metav1.ManagedFieldsEntry {
		return metav1.ManagedFieldsEntry{Manager: manager, Operation: metav1.ManagedFieldsOperationUpdate, Time: &metav1.Time{Time: at},
			FieldsType: "FieldsV1", FieldsV1: &metav1.FieldsV1{Raw: []byte(fields)}}
	}
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{ManagedFields: []metav1.ManagedFieldsEntry{
		entry("kubelet", now, `{"f:status":{"f:conditions":{}}}`),
		entry("kubectl-annotate", now.Add(-time.Minute), `{"f:metadata":{"f:annotations":{"f:`+ClearFaultsAnnotation+`":{}}}}`),
	}}}
	at, ok := annotationSetAt(node, ClearFaultsAnnotation)
	if !ok || !at.Equal(now.Add(-time.Minute)) {
		t.Fatalf("annotationSetAt = %v, %v; want the annotating entry's time %v", at, ok, now.Add(-time.Minute))
	}
	if _, ok := annotationSetAt(&v1.Node{}, ClearFaultsAnnotation); ok {
		t.Error("annotationSetAt found a time without managed fields")
	}
	value := now.Add(-30 * time.Second).UTC().Format(time.RFC3339)
	if _, err := parseClearFaults(value, at); err == nil || !strings.Contains(err.Error(), "ahead of when the annotation was set") {
		t.Errorf("a time 30 s after the annotation was set: err %v, want it refused", err)
	}
	if req, err := parseClearFaults(value, now); err != nil || !req.before.Equal(now.Add(-30*time.Second)) {
		t.Errorf("a time 30 s before the annotation was set: %+v, %v", req, err)
	}
	for _, bad := range []string{"", "soon", value + " gpu-1,", value + " gpu-1 gpu-2"} {
		if _, err := parseClearFaults(bad, now); err == nil {
			t.Errorf("parseClearFaults(%q) accepted", bad)
		}
	}
	req, err := parseClearFaults("2026-12-06T10:00:00.5+02:00 gpu-1,GPU-abc", now)
	if err != nil || !req.before.Equal(time.Date(2026, 12, 6, 8, 0, 0, 5e8, time.UTC)) || strings.Join(req.gpus, ",") != "gpu-1,GPU-abc" {
		t.Errorf("fractional seconds and an offset with two GPUs: %+v, %v", req, err)
	}
}
