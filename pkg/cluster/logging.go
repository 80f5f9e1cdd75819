package cluster

import (
	"flag"
	"fmt"
	"io"

	"k8s.io/klog/v2"
)

// SetUpLogging sends the logs of everything running in process (apiserver,
// etcd, controllers, schedulers, agents) to a file at the given verbosity,
// or discards them when path is empty, so that a command's own output stays
// readable.
func SetUpLogging(path string, verbosity int) error {
	kfs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(kfs)
	for name, value := range map[string]string{
		"v":               fmt.Sprint(verbosity),
		"logtostderr":     "false",
		"alsologtostderr": "false",
		"stderrthreshold": "FATAL",
	} {
		if err := kfs.Set(name, value); err != nil {
			return fmt.Errorf("klog flag %s: %w", name, err)
		}
	}
	if path == "" {
		klog.SetOutput(io.Discard) //nolint:logcheck // the process's log output is configured here, once
		return nil
	}
	return kfs.Set("log_file", path)
}
