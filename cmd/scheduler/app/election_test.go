package app

import (
	"strings"
	"testing"

	"k8s.io/klog/v2/ktesting"

	"github.com/topodra/topodra/config"
)

// TestCheckElection: the command refuses to run without --config, with
// leader election off unless --allow-unelected, and on kube-scheduler's
// lease without a default-scheduler profile; flags override the file as
// kube-scheduler applies them. The shipped configurations pass.
func TestCheckElection(t *testing.T) {
	logger, _ := ktesting.NewTestContext(t)
	shipped := writeConfig(t, string(config.SchedulerConfig))
	multi := writeConfig(t, string(config.MultiProfileConfig))
	unelected := writeConfig(t, topodraProfile)
	onDefaultLease := writeConfig(t, strings.Replace(string(config.SchedulerConfig), "resourceName: topodra-scheduler", "resourceName: kube-scheduler", 1))
	for name, tc := range map[string]struct {
		args    []string
		wantErr string
	}{
		"shipped":                                 {args: []string{"--config", shipped}},
		"shipped multi-profile":                   {args: []string{"--config", multi}},
		"no config":                               {wantErr: "needs --config"},
		"leader election off in the file":         {args: []string{"--config", unelected}, wantErr: "leader election is off"},
		"leader election off, allowed":            {args: []string{"--config", unelected, "--" + AllowUnelectedFlag}},
		"leader election off by flag":             {args: []string{"--config", shipped, "--leader-elect=false"}, wantErr: "--allow-unelected where exactly one instance ever runs"},
		"kube-scheduler's lease in the file":      {args: []string{"--config", onDefaultLease}, wantErr: "the default scheduler's lease"},
		"kube-scheduler's lease by flag":          {args: []string{"--config", shipped, "--leader-elect-resource-name=kube-scheduler"}, wantErr: "the default scheduler's lease"},
		"kube-scheduler's lease elsewhere":        {args: []string{"--config", onDefaultLease, "--leader-elect-resource-namespace=topodra"}},
		"kube-scheduler's lease, default profile": {args: []string{"--config", multi, "--leader-elect-resource-name=kube-scheduler"}},
	} {
		t.Run(name, func(t *testing.T) {
			cmd := NewCommand()
			if err := cmd.Flags().Parse(tc.args); err != nil {
				t.Fatal(err)
			}
			err := checkElection(logger, cmd.Flags())
			switch {
			case tc.wantErr == "" && err != nil:
				t.Errorf("refused: %v", err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Errorf("error %v, want one saying %q", err, tc.wantErr)
			}
		})
	}
}

// TestCommandRefusesUnelected: the command itself refuses leader election
// off before it sets a scheduler up.
func TestCommandRefusesUnelected(t *testing.T) {
	cmd := NewCommand()
	cmd.SetArgs([]string{"--config", writeConfig(t, topodraProfile)})
	cmd.SilenceUsage, cmd.SilenceErrors = true, true
	if err := cmd.Execute(); err == nil || !strings.Contains(err.Error(), "leader election is off") {
		t.Errorf("Execute: %v, want the refusal of leader election off", err)
	}
}
