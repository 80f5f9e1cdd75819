package topology

import (
	"slices"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/utils/ptr"
)

func TestLookupAttribute(t *testing.T) {
	attrs := map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		"nvlinkClique":                     {StringValue: ptr.To("clique-0")},
		"pcieRoot":                         {StringValue: ptr.To("short")},
		"resource.kubernetes.io/numaNode":  {IntValue: ptr.To[int64](1)},
		"other.example.com/nvlinkClique":   {StringValue: ptr.To("foreign")},
		"gpu.topodra.io/unused-full-name":  {StringValue: ptr.To("x")},
		"resource.kubernetes.io/pciBusID":  {StringValue: ptr.To("0000:3b:00.0")},
		"resource.kubernetes.io/pcieRoot2": {StringValue: ptr.To("y")},
	}
	testcases := map[string]struct {
		driver string
		name   resourceapi.QualifiedName
		want   string // "" = not found
	}{
		"short name in own domain":         {driver: DriverName, name: AttrNVLinkClique, want: "clique-0"},
		"short name is not another domain": {driver: DriverName, name: AttrPCIeRoot},
		"short name of another driver":     {driver: "nic.example.com", name: AttrNVLinkClique},
		"fully qualified":                  {driver: DriverName, name: AttrNUMANode, want: "1"},
		"fully qualified other domain":     {driver: DriverName, name: "other.example.com/nvlinkClique", want: "foreign"},
		"short query means own domain":     {driver: DriverName, name: "unused-full-name", want: "x"},
		"missing":                          {driver: DriverName, name: "resource.kubernetes.io/nothing"},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			attr, ok := LookupAttribute(tc.driver, attrs, tc.name)
			got := ""
			if ok {
				got, _ = DomainValue(attr)
			}
			if got != tc.want {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
}

func TestDomainValue(t *testing.T) {
	testcases := map[string]struct {
		attr   resourceapi.DeviceAttribute
		want   string
		wantOK bool
	}{
		"int":         {attr: resourceapi.DeviceAttribute{IntValue: ptr.To[int64](3)}, want: "3", wantOK: true},
		"int list":    {attr: resourceapi.DeviceAttribute{IntValues: []int64{1, 0}}, want: "1", wantOK: true},
		"string":      {attr: resourceapi.DeviceAttribute{StringValue: ptr.To("pci0000:00")}, want: "pci0000:00", wantOK: true},
		"string list": {attr: resourceapi.DeviceAttribute{StringValues: []string{"a", "b"}}, want: "a", wantOK: true},
		"bool":        {attr: resourceapi.DeviceAttribute{BoolValue: ptr.To(true)}, want: "true", wantOK: true},
		"empty":       {attr: resourceapi.DeviceAttribute{}},
		"empty list":  {attr: resourceapi.DeviceAttribute{IntValues: []int64{}}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			got, ok := DomainValue(tc.attr)
			if got != tc.want || ok != tc.wantOK {
				t.Errorf("got %q, %v; want %q, %v", got, ok, tc.want, tc.wantOK)
			}
		})
	}
}

func TestDeviceCoordinates(t *testing.T) {
	dev := func(root string, numa int64, clique string) *resourceapi.Device {
		d := &resourceapi.Device{Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			AttrNUMANode: {IntValue: ptr.To(numa)},
		}}
		if root != "" {
			d.Attributes[AttrPCIeRoot] = resourceapi.DeviceAttribute{StringValue: ptr.To(root)}
		}
		if clique != "" {
			d.Attributes["nvlinkClique"] = resourceapi.DeviceAttribute{StringValue: ptr.To(clique)}
		}
		return d
	}
	testcases := map[string]struct {
		device *resourceapi.Device
		want   Coordinates
	}{
		"all attributes":           {device: dev("r0", 0, "c"), want: Coordinates{"c", "r0", "0"}},
		"without pcieRoot, clique": {device: dev("", 1, ""), want: Coordinates{"", "", "1"}},
		"clique by its short name": {device: dev("r1", 1, "c1"), want: Coordinates{"c1", "r1", "1"}},
	}
	for name, tc := range testcases {
		t.Run(name, func(t *testing.T) {
			if got := DeviceCoordinates(DriverName, tc.device, DefaultAttributes); !slices.Equal(got, tc.want) {
				t.Errorf("got %q, want %q", got, tc.want)
			}
		})
	}
	if FormatDomain(AttrPCIeRoot, "r0") != "resource.kubernetes.io/pcieRoot=r0" {
		t.Errorf("FormatDomain: %s", FormatDomain(AttrPCIeRoot, "r0"))
	}
	if ShortName(AttrNUMANode) != "numaNode" {
		t.Errorf("ShortName: %s", ShortName(AttrNUMANode))
	}
}
