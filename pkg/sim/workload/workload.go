// Package workload reads the simulator's workload files: Kubernetes YAML
// (or JSON) documents with Pods, ResourceClaimTemplates and
// PriorityClasses, the pods annotated with their arrival and lifetime in
// ticks.
package workload

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	schedulingv1 "k8s.io/api/scheduling/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/kubernetes/scheme"
)

// Annotations on the pods of a workload file.
const (
	// AnnotationArrival is the tick at which the pod is created (an
	// integer >= 0). Pods without it arrive one per tick in file order,
	// after the last annotated arrival.
	AnnotationArrival = "sim.topodra.io/arrival"
	// AnnotationLifetime is how many ticks the pod runs once bound before
	// it is deleted (an integer >= 1). Without it the pod runs to the end.
	AnnotationLifetime = "sim.topodra.io/lifetime"
)

// Job is one pod of a workload.
type Job struct {
	// Pod is created as given except for its namespace and schedulerName,
	// which each run sets.
	Pod *v1.Pod
	// Arrival is the tick at which the pod is created.
	Arrival int
	// Lifetime is how many ticks the pod runs once bound; 0 means until
	// the end of the run.
	Lifetime int
}

// Workload is what a run creates: claim templates up front, then pods over
// ticks.
type Workload struct {
	Templates []*resourceapi.ResourceClaimTemplate
	// PriorityClasses are created with the templates; a pod may name only
	// these (priorityClassName).
	PriorityClasses []*schedulingv1.PriorityClass
	Jobs            []Job
	// Drain is how many ticks the run goes on after the last arrival,
	// with finished pods leaving and pending pods still being scheduled.
	Drain int
}

// Ticks is the number of ticks the workload spans.
func (w *Workload) Ticks() int {
	n := 0
	for _, j := range w.Jobs {
		n = max(n, j.Arrival+1)
	}
	return n + w.Drain
}

// Load reads a workload file: Kubernetes YAML (or JSON) documents,
// each a Pod, a ResourceClaimTemplate or a PriorityClass (a v1 List of
// them works too).
// Pods take their arrival and lifetime from AnnotationArrival and
// AnnotationLifetime. Every claim of a pod must come from a template in the
// file (resourceClaimTemplateName), since each run uses a fresh cluster.
func Load(path string) (*Workload, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read workload: %w", err)
	}
	w, err := Parse(data)
	if err != nil {
		return nil, fmt.Errorf("workload %s: %w", path, err)
	}
	return w, nil
}

// Parse parses the contents of a workload file; see Load.
func Parse(data []byte) (*Workload, error) {
	reader := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	decoder := scheme.Codecs.UniversalDeserializer()
	var pods []*v1.Pod
	w := &Workload{}
	var add func(obj any, doc int) error
	add = func(obj any, doc int) error {
		switch o := obj.(type) {
		case *v1.Pod:
			pods = append(pods, o)
		case *resourceapi.ResourceClaimTemplate:
			w.Templates = append(w.Templates, o)
		case *schedulingv1.PriorityClass:
			w.PriorityClasses = append(w.PriorityClasses, o)
		case *v1.List:
			for _, item := range o.Items {
				inner, _, err := decoder.Decode(item.Raw, nil, nil)
				if err != nil {
					return fmt.Errorf("document %d: list item: %w", doc, err)
				}
				if err := add(inner, doc); err != nil {
					return err
				}
			}
		default:
			return fmt.Errorf("document %d: %T is not supported (only Pods, resource.k8s.io/v1 ResourceClaimTemplates and scheduling.k8s.io/v1 PriorityClasses)", doc, obj)
		}
		return nil
	}
	for doc := 1; ; doc++ {
		raw, err := reader.Read()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", doc, err)
		}
		if len(bytes.TrimSpace(raw)) == 0 || isComment(raw) {
			continue
		}
		obj, _, err := decoder.Decode(raw, nil, nil)
		if err != nil {
			return nil, fmt.Errorf("document %d: %w", doc, err)
		}
		if err := add(obj, doc); err != nil {
			return nil, err
		}
	}
	if len(pods) == 0 {
		return nil, errors.New("no pods")
	}
	templates := map[string]bool{}
	for _, t := range w.Templates {
		if t.Name == "" {
			return nil, errors.New("a ResourceClaimTemplate has no name")
		}
		if templates[t.Name] {
			return nil, fmt.Errorf("ResourceClaimTemplate %s defined twice", t.Name)
		}
		templates[t.Name] = true
	}
	classes := map[string]bool{}
	for _, c := range w.PriorityClasses {
		if c.Name == "" {
			return nil, errors.New("a PriorityClass has no name")
		}
		if classes[c.Name] {
			return nil, fmt.Errorf("PriorityClass %s defined twice", c.Name)
		}
		classes[c.Name] = true
	}
	names := map[string]bool{}
	next := 0
	for _, p := range pods {
		if p.Name == "" {
			return nil, errors.New("a pod has no name (generateName is not supported)")
		}
		if names[p.Name] {
			return nil, fmt.Errorf("pod %s defined twice", p.Name)
		}
		names[p.Name] = true
		if c := p.Spec.PriorityClassName; c != "" && !classes[c] {
			return nil, fmt.Errorf("pod %s: PriorityClass %s is not in the file", p.Name, c)
		}
		if p.Spec.Priority != nil {
			return nil, fmt.Errorf("pod %s: set priorityClassName, not priority", p.Name)
		}
		for _, c := range p.Spec.ResourceClaims {
			switch {
			case c.ResourceClaimTemplateName == nil:
				return nil, fmt.Errorf("pod %s: claim %s must use resourceClaimTemplateName", p.Name, c.Name)
			case !templates[*c.ResourceClaimTemplateName]:
				return nil, fmt.Errorf("pod %s: claim %s: ResourceClaimTemplate %s is not in the file", p.Name, c.Name, *c.ResourceClaimTemplateName)
			}
		}
		if v, ok := p.Annotations[AnnotationArrival]; ok {
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				return nil, fmt.Errorf("pod %s: annotation %s must be an integer >= 0, got %q", p.Name, AnnotationArrival, v)
			}
			next = max(next, n+1)
		}
	}
	for _, p := range pods {
		job := Job{Pod: p}
		if v, ok := p.Annotations[AnnotationArrival]; ok {
			job.Arrival, _ = strconv.Atoi(v)
		} else {
			job.Arrival = next
			next++
		}
		if v, ok := p.Annotations[AnnotationLifetime]; ok {
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return nil, fmt.Errorf("pod %s: annotation %s must be an integer >= 1, got %q", p.Name, AnnotationLifetime, v)
			}
			job.Lifetime = n
		}
		w.Jobs = append(w.Jobs, job)
	}
	slices.SortStableFunc(w.Jobs, func(a, b Job) int { return a.Arrival - b.Arrival })
	return w, nil
}

func isComment(doc []byte) bool {
	for _, line := range bytes.Split(doc, []byte("\n")) {
		line = bytes.TrimSpace(line)
		if len(line) > 0 && line[0] != '#' && !bytes.Equal(line, []byte("---")) {
			return false
		}
	}
	return true
}
