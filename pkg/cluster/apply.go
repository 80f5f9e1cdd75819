package cluster

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
)

// Apply creates every object of a multi-document YAML manifest, or updates
// it where it exists, as `kubectl apply` would for a first apply. edit, if
// not nil, may change each object first; returning false skips it.
func (c *Cluster) Apply(ctx context.Context, manifest []byte, edit func(*unstructured.Unstructured) bool) error {
	dyn, err := dynamic.NewForConfig(c.Config)
	if err != nil {
		return err
	}
	disc, err := discovery.NewDiscoveryClientForConfig(c.Config)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(disc))
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(manifest)))
	for {
		doc, err := reader.Read()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("read manifest: %w", err)
		}
		obj := &unstructured.Unstructured{}
		if err := utilyaml.Unmarshal(doc, &obj.Object); err != nil {
			return fmt.Errorf("parse manifest: %w", err)
		}
		if len(obj.Object) == 0 {
			continue
		}
		if edit != nil && !edit(obj) {
			continue
		}
		gvk := obj.GroupVersionKind()
		mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return fmt.Errorf("%s %s: %w", gvk.Kind, obj.GetName(), err)
		}
		client := dyn.Resource(mapping.Resource).Namespace(obj.GetNamespace())
		_, err = client.Create(ctx, obj, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			var old *unstructured.Unstructured
			old, err = client.Get(ctx, obj.GetName(), metav1.GetOptions{})
			if err == nil {
				obj.SetResourceVersion(old.GetResourceVersion())
				_, err = client.Update(ctx, obj, metav1.UpdateOptions{})
			}
		}
		if err != nil {
			return fmt.Errorf("apply %s %s: %w", gvk.Kind, obj.GetName(), err)
		}
	}
}
