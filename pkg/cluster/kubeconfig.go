package cluster

import (
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// WriteKubeconfig writes a kubeconfig file for cfg: cluster and context
// "topodra", user "admin", with cfg's CA, TLS server name, token and client
// certificate, where set.
func WriteKubeconfig(cfg *rest.Config, path string) error {
	return writeKubeconfigAs(cfg, path, "")
}

// writeKubeconfigAs is WriteKubeconfig, with the admin impersonating user
// (in group system:authenticated) where user is not empty.
func writeKubeconfigAs(cfg *rest.Config, path, user string) error {
	kc := clientcmdapi.NewConfig()
	kc.Clusters["topodra"] = &clientcmdapi.Cluster{
		Server:                   cfg.Host,
		CertificateAuthorityData: cfg.TLSClientConfig.CAData,
		TLSServerName:            cfg.TLSClientConfig.ServerName,
		InsecureSkipTLSVerify:    cfg.TLSClientConfig.Insecure,
	}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{
		Token:                 cfg.BearerToken,
		ClientCertificateData: cfg.TLSClientConfig.CertData,
		ClientKeyData:         cfg.TLSClientConfig.KeyData,
	}
	if user != "" {
		kc.AuthInfos["admin"].Impersonate = user
		kc.AuthInfos["admin"].ImpersonateGroups = []string{"system:authenticated"}
	}
	kc.Contexts["topodra"] = &clientcmdapi.Context{Cluster: "topodra", AuthInfo: "admin"}
	kc.CurrentContext = "topodra"
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("write kubeconfig: %w", err)
	}
	if err := clientcmd.WriteToFile(*kc, path); err != nil {
		return fmt.Errorf("write kubeconfig %s: %w", path, err)
	}
	return nil
}
