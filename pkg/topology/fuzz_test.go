package topology

import (
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
)

// FuzzTopologyAttributes feeds attributes of every type and size, under
// short and qualified names, through the lookup and the coordinates that
// the allocator builds domains from.
func FuzzTopologyAttributes(f *testing.F) {
	f.Add(DriverName, "pcieRoot", uint8(0), "pci0000:16", int64(0), false, uint8(0), true)
	f.Add(DriverName, string(AttrNUMANode), uint8(1), "", int64(1), false, uint8(0), false)
	f.Add("resource.kubernetes.io", "numaNode", uint8(5), "", int64(-3), false, uint8(3), true)
	f.Add("nic.example.com", "nvlinkClique", uint8(2), "", int64(0), true, uint8(1), true)
	f.Add("", "", uint8(7), strings.Repeat("x", 64), int64(1<<62), true, uint8(0), false)
	f.Add("a/b", "c/d/e", uint8(3), "1.2.3", int64(0), false, uint8(9), true)
	f.Fuzz(func(t *testing.T, driver, name string, kind uint8, s string, i int64, b bool, n uint8, short bool) {
		var attr resourceapi.DeviceAttribute
		count := int(n % 8)
		switch kind % 8 {
		case 0:
			attr.StringValue = &s
		case 1:
			attr.IntValue = &i
		case 2:
			attr.BoolValue = &b
		case 3:
			attr.VersionValue = &s
		case 4:
			for range count {
				attr.StringValues = append(attr.StringValues, s)
			}
		case 5:
			for j := range count {
				attr.IntValues = append(attr.IntValues, i+int64(j))
			}
		case 6:
			for range count {
				attr.BoolValues = append(attr.BoolValues, b)
			}
		case 7:
			for range count {
				attr.VersionValues = append(attr.VersionValues, s)
			}
		}
		key := resourceapi.QualifiedName(name)
		if !short {
			key = resourceapi.QualifiedName(driver + "/" + name)
		}
		device := &resourceapi.Device{Name: "d", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{key: attr}}
		qualified := resourceapi.QualifiedName(driver + "/" + name)
		attributes := append([]resourceapi.QualifiedName{qualified, key}, DefaultAttributes...)

		coords := DeviceCoordinates(driver, device, attributes)
		if len(coords) != len(attributes) {
			t.Fatalf("%d coordinates for %d attributes", len(coords), len(attributes))
		}
		value, hasValue := DomainValue(attr)
		// The attribute is found under the name it was published with.
		if got, ok := LookupAttribute(driver, device.Attributes, key); !ok || !equalAttr(got, attr) {
			t.Errorf("lookup of %q as published: found %v", key, ok)
		}
		if hasValue && coords[1] != value {
			t.Errorf("coordinate of %q = %q, want %q", key, coords[1], value)
		}
		// A short name published by the driver is its own domain's
		// qualified name (for valid driver names, which have no "/", and
		// names without a domain of their own).
		if short && !strings.Contains(name, "/") && !strings.Contains(driver, "/") {
			if _, ok := LookupAttribute(driver, device.Attributes, qualified); !ok {
				t.Errorf("short name %q of driver %q not found as %q", name, driver, qualified)
			}
		}
		// Without a value, no coordinate.
		if !hasValue {
			for i, c := range coords {
				if c != "" {
					t.Errorf("attribute without a value gave coordinate %d = %q", i, c)
				}
			}
		}
		if got := FormatDomain(key, value); !strings.HasSuffix(got, "="+value) {
			t.Errorf("FormatDomain(%q, %q) = %q", key, value, got)
		}
		_ = ShortName(key)
	})
}

func equalAttr(a, b resourceapi.DeviceAttribute) bool {
	va, oka := DomainValue(a)
	vb, okb := DomainValue(b)
	return va == vb && oka == okb
}
