package cluster

import (
	"os"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/kubernetes/test/utils/ktesting"
)

// TestStartStop starts a cluster, uses it through the returned client and
// through the kubeconfig file, and checks that Stop releases everything.
func TestStartStop(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd and kube-apiserver")
	}
	tCtx := ktesting.Init(t)
	start := time.Now()
	c, err := Start(tCtx, Options{})
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Logf("control plane up in %s", time.Since(start))
	defer c.Stop()

	node, err := CreateReadyNode(tCtx, c.Client, "node-0", nil)
	if err != nil {
		t.Fatal(err)
	}
	if node.Labels["kubernetes.io/hostname"] != "node-0" {
		t.Errorf("node labels %v lack the hostname", node.Labels)
	}
	// resource.k8s.io/v1 is served.
	if _, err := c.Client.ResourceV1().DeviceClasses().Create(tCtx, DeviceClass("gpu", "gpu.example.com"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create DeviceClass: %v", err)
	}

	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		t.Fatalf("load kubeconfig: %v", err)
	}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.CoreV1().Nodes().Get(tCtx, "node-0", metav1.GetOptions{}); err != nil {
		t.Fatalf("get node through the kubeconfig: %v", err)
	}

	stopped := false
	c.AddStop(func() { stopped = true })
	start = time.Now()
	c.Stop()
	t.Logf("stopped in %s", time.Since(start))
	c.Stop() // a second call returns at once
	if !stopped {
		t.Error("Stop did not call the registered stop function")
	}
	if _, err := os.Stat(c.Dir); !os.IsNotExist(err) {
		t.Errorf("temporary directory %s still there after Stop: %v", c.Dir, err)
	}
	if _, err := c.Client.CoreV1().Nodes().Get(tCtx, "node-0", metav1.GetOptions{}); err == nil {
		t.Error("apiserver still answers after Stop")
	}
}

// A flag the apiserver does not know fails Start with an error (no panic,
// no exit), after etcd has started and been stopped again.
func TestStartBadFlag(t *testing.T) {
	tCtx := ktesting.Init(t)
	dir := t.TempDir()
	_, err := Start(tCtx, Options{Dir: dir, APIServerFlags: []string{"--no-such-flag"}})
	if err == nil {
		t.Fatal("Start accepted an unknown apiserver flag")
	}
	t.Logf("error: %v", err)
}

// TestRestartAPIServer stops the apiserver and starts it again on the same
// etcd: the objects are still there, and the cluster's client and its
// kubeconfig work again without being rebuilt.
func TestRestartAPIServer(t *testing.T) {
	tCtx := ktesting.Init(t)
	c, err := Start(tCtx, Options{})
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	defer c.Stop()
	if _, err := CreateReadyNode(tCtx, c.Client, "node-0", nil); err != nil {
		t.Fatal(err)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", c.Kubeconfig)
	if err != nil {
		t.Fatalf("load kubeconfig: %v", err)
	}
	fromFile, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}

	c.StopAPIServer()
	if _, err := c.Client.CoreV1().Nodes().Get(tCtx, "node-0", metav1.GetOptions{}); err == nil {
		t.Fatal("apiserver still answers after StopAPIServer")
	}
	if err := c.StartAPIServer(tCtx); err != nil {
		t.Fatalf("start the apiserver again: %v", err)
	}
	for name, client := range map[string]kubernetes.Interface{"cluster client": c.Client, "kubeconfig": fromFile} {
		if _, err := client.CoreV1().Nodes().Get(tCtx, "node-0", metav1.GetOptions{}); err != nil {
			t.Errorf("%s: get node after the restart: %v", name, err)
		}
	}
}
