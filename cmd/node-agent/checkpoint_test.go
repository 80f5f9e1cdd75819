package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/pkg/agent"
	"github.com/topodra/topodra/pkg/agent/checkpoint"
	"github.com/topodra/topodra/pkg/agent/discovery"
	"github.com/topodra/topodra/pkg/agent/mockgpu"
)

// TestCheckpointEventSentBeforeExit: when the agent cannot start because
// its checkpoint is damaged, the Warning event on the Node, naming the
// file, is in the API server by the time waitAgent returns (the command
// exits right after).
func TestCheckpointEventSentBeforeExit(t *testing.T) {
	_, ctx := ktesting.NewTestContext(t)
	stateDir := t.TempDir()
	if err := os.WriteFile(filepath.Join(stateDir, checkpoint.FileName), []byte(`{"version":"`+checkpoint.Version+`","checksum":1,"data":{"claims":{}}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	m, err := mockgpu.New(mockgpu.ProfileDGXH100, mockgpu.Options{NodeName: "node-1"})
	if err != nil {
		t.Fatal(err)
	}
	disc, err := discovery.NewNVML(discovery.NVMLOptions{Lib: m.NVML(), Sysfs: m.Sysfs()})
	if err != nil {
		t.Fatal(err)
	}
	client := fake.NewClientset(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}})
	sink := newEventSink(client)
	broadcaster := events.NewBroadcaster(sink)
	broadcaster.StartRecordingToSink(ctx.Done())
	defer broadcaster.Shutdown()
	a, err := agent.Start(ctx, agent.Options{
		NodeName:    "node-1",
		KubeClient:  client,
		Discovery:   disc,
		PublishOnly: true,
		StateDir:    stateDir,
		CDIDir:      t.TempDir(),
		Recorder:    broadcaster.NewRecorder(scheme.Scheme, "topodra-node-agent"),
	})
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	err = waitAgent(ctx, sink, a)
	if err == nil {
		t.Fatal("agent started with a damaged checkpoint")
	}
	if !errors.Is(err, agent.ErrCheckpoint) {
		t.Errorf("error %v, want ErrCheckpoint", err)
	}
	list, err := client.EventsV1().Events("").List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, ev := range list.Items {
		if ev.Reason == agent.ReasonCheckpointUnreadable && ev.Type == v1.EventTypeWarning && ev.Regarding.Kind == "Node" && ev.Regarding.Name == "node-1" &&
			strings.Contains(ev.Note, filepath.Join(stateDir, checkpoint.FileName)) {
			found = true
		}
	}
	if !found {
		t.Errorf("no %s Warning on the Node naming the checkpoint among %d events: %+v", agent.ReasonCheckpointUnreadable, len(list.Items), list.Items)
	}
}
