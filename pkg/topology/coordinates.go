package topology

import (
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
)

// DefaultAttributes are the topology attributes that define domains when the
// configuration does not say otherwise, in priority order: GPUs joined by
// NVLink, devices behind one PCIe root, devices on one NUMA node. The
// allocator prefers the smallest domain that fits whatever its attribute;
// the order only breaks ties between equally small domains (an NVLink pair
// beats two GPUs that merely share a PCIe switch).
var DefaultAttributes = []resourceapi.QualifiedName{AttrNVLinkClique, AttrPCIeRoot, AttrNUMANode}

// LookupAttribute returns the attribute called name (a fully qualified name,
// "domain/id") of a device published by driver, with the qualified-name
// semantics of DRA: a slice may publish an attribute of its own driver's
// domain without the domain prefix ("nvlinkClique" in a slice of driver
// gpu.topodra.io is gpu.topodra.io/nvlinkClique). A short name never matches a
// name of another domain: "pcieRoot" is not resource.kubernetes.io/pcieRoot.
func LookupAttribute(driver string, attrs map[resourceapi.QualifiedName]resourceapi.DeviceAttribute, name resourceapi.QualifiedName) (resourceapi.DeviceAttribute, bool) {
	if attr, ok := attrs[name]; ok {
		return attr, true
	}
	domain, id, ok := strings.Cut(string(name), "/")
	if !ok {
		// Already short: it refers to the driver's own domain.
		attr, found := attrs[resourceapi.QualifiedName(driver+"/"+string(name))]
		return attr, found
	}
	if domain != driver {
		return resourceapi.DeviceAttribute{}, false
	}
	attr, found := attrs[resourceapi.QualifiedName(id)]
	return attr, found
}

// DomainValue turns an attribute into the value that identifies a domain.
// Scalars are formatted as strings; for a list (KEP-5491 list-type
// attributes, e.g. numaNode [0, 1]) the first entry counts, which for
// numaNode is the physical node. It reports false for an empty attribute.
func DomainValue(attr resourceapi.DeviceAttribute) (string, bool) {
	switch {
	case attr.StringValue != nil:
		return *attr.StringValue, true
	case attr.IntValue != nil:
		return strconv.FormatInt(*attr.IntValue, 10), true
	case attr.BoolValue != nil:
		return strconv.FormatBool(*attr.BoolValue), true
	case attr.VersionValue != nil:
		return *attr.VersionValue, true
	case len(attr.StringValues) > 0:
		return attr.StringValues[0], true
	case len(attr.IntValues) > 0:
		return strconv.FormatInt(attr.IntValues[0], 10), true
	case len(attr.BoolValues) > 0:
		return strconv.FormatBool(attr.BoolValues[0]), true
	case len(attr.VersionValues) > 0:
		return attr.VersionValues[0], true
	}
	return "", false
}

// Coordinates are a device's position in the node's topology: one domain
// value per configured attribute, in the order of that configuration. An
// empty string means the device does not publish the attribute, so it belongs
// to no domain of that attribute.
type Coordinates []string

// DeviceCoordinates reads the coordinates of a device of driver for the
// attributes (fully qualified names, in priority order).
func DeviceCoordinates(driver string, device *resourceapi.Device, attributes []resourceapi.QualifiedName) Coordinates {
	coords := make(Coordinates, len(attributes))
	for i, name := range attributes {
		if attr, ok := LookupAttribute(driver, device.Attributes, name); ok {
			if value, ok := DomainValue(attr); ok {
				coords[i] = value
			}
		}
	}
	return coords
}

// FormatDomain formats a domain as "attribute=value".
func FormatDomain(attribute resourceapi.QualifiedName, value string) string {
	return string(attribute) + "=" + value
}

// ShortName returns the part of a qualified name after the domain, e.g.
// "pcieRoot" for resource.kubernetes.io/pcieRoot, for user-facing messages.
func ShortName(name resourceapi.QualifiedName) string {
	if _, id, ok := strings.Cut(string(name), "/"); ok {
		return id
	}
	return string(name)
}
