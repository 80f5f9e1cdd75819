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

func TestGroupDomains(t *testing.T) {
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
	devices := []*resourceapi.Device{dev("r0", 0, "c"), dev("r0", 0, "c"), dev("r1", 1, "c"), dev("", 1, "")}
	var coords []Coordinates
	for _, d := range devices {
		coords = append(coords, DeviceCoordinates(DriverName, d, DefaultAttributes))
	}
	if !slices.Equal(coords[3], Coordinates{"", "", "1"}) {
		t.Errorf("coordinates of a device without pcieRoot and clique: %q", coords[3])
	}
	var got []string
	for _, d := range GroupDomains(coords, DefaultAttributes) {
		got = append(got, d.String()+"#"+string(rune('0'+len(d.Members))))
	}
	want := []string{
		"gpu.topodra.io/nvlinkClique=c#3",
		"resource.kubernetes.io/pcieRoot=r0#2",
		"resource.kubernetes.io/pcieRoot=r1#1",
		"resource.kubernetes.io/numaNode=0#2",
		"resource.kubernetes.io/numaNode=1#2",
	}
	if !slices.Equal(got, want) {
		t.Errorf("got %v, want %v", got, want)
	}
	if ShortName(AttrNUMANode) != "numaNode" {
		t.Errorf("ShortName: %s", ShortName(AttrNUMANode))
	}
}
