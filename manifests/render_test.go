package manifests

import (
	"fmt"
	"io/fs"
	"path"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

// Render builds the kustomization in dir ("base" or "overlays/<name>") with
// kustomize's default options, as `kubectl kustomize` does, and returns the
// multi-document YAML.
func Render(dir string) ([]byte, error) {
	return renderEdited(dir, nil)
}

// renderEdited renders dir as Render does, from copies of the files that
// edit (where not nil) may change first: it gets each file's path, such as
// "base/ownership.yaml", and returns the content to use.
func renderEdited(dir string, edit func(path string, data []byte) []byte) ([]byte, error) {
	memFS, err := copyManifests(edit)
	if err != nil {
		return nil, err
	}
	return run(memFS, dir)
}

// RenderWithComponents renders a kustomization of an admin's own that
// takes the kustomization in dir as its resource and adds components
// (directories such as "components/monitoring"), as docs/install.md
// shows, and returns the multi-document YAML.
func RenderWithComponents(dir string, components ...string) ([]byte, error) {
	return renderMine(dir, components, "")
}

// renderMine renders a kustomization of an admin's own, as
// RenderWithComponents does, with extra (YAML of further fields, such as
// patches) appended to it.
func renderMine(dir string, components []string, extra string) ([]byte, error) {
	memFS, err := copyManifests(nil)
	if err != nil {
		return nil, err
	}
	kustomization := "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n- ../" + dir + "\ncomponents:\n"
	for _, c := range components {
		kustomization += "- ../" + c + "\n"
	}
	kustomization += extra
	if err := memFS.MkdirAll("/mine"); err != nil {
		return nil, err
	}
	if err := memFS.WriteFile("/mine/kustomization.yaml", []byte(kustomization)); err != nil {
		return nil, err
	}
	return run(memFS, "mine")
}

// copyManifests copies the embedded manifests into an in-memory file
// system, each file as edit (where not nil) returns it.
func copyManifests(edit func(path string, data []byte) []byte) (filesys.FileSystem, error) {
	memFS := filesys.MakeFsInMemory()
	err := fs.WalkDir(FS, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		data, err := FS.ReadFile(p)
		if err != nil {
			return err
		}
		if edit != nil {
			data = edit(p, data)
		}
		if err := memFS.MkdirAll(path.Dir("/" + p)); err != nil {
			return err
		}
		return memFS.WriteFile("/"+p, data)
	})
	if err != nil {
		return nil, fmt.Errorf("copy manifests: %w", err)
	}
	return memFS, nil
}

// run builds the kustomization in dir of memFS with kustomize's default
// options, as `kubectl kustomize` does.
func run(memFS filesys.FileSystem, dir string) ([]byte, error) {
	resources, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(memFS, "/"+dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize %s: %w", dir, err)
	}
	out, err := resources.AsYaml()
	if err != nil {
		return nil, fmt.Errorf("kustomize %s: %w", dir, err)
	}
	return out, nil
}
