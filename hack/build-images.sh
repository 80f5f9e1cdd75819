#!/usr/bin/env bash
# build-images.sh: build the topodra-scheduler and topodra-node-agent images
# with the version stamped in (the same ldflags as `make build`). The
# scheduler image also holds /topodra-check (the invariant checker that
# manifests/components/invariant-check runs as a CronJob).
#   hack/build-images.sh                      # tag: `git describe --tags --always --dirty`
#   VERSION=v0.2.0 REGISTRY=example.com/me hack/build-images.sh
# The tag defaults to what `git describe` says of this checkout, so that
# every commit gets a tag of its own; outside a git checkout it is the
# manifests' (manifests/base/kustomization.yaml). The workloads pull with
# the default imagePullPolicy (IfNotPresent): a node that already has a tag
# keeps its image, so an upgrade needs a tag that was never pushed before
# (see "Upgrading" in docs/install.md).
# The tag built is the only line on stdout (docker's output goes to stderr):
#   tag=$(REGISTRY=example.com/me hack/build-images.sh)
# Extra arguments go to every `docker build`, e.g. --build-arg GO_IMAGE=golang@sha256:...
# Afterwards, point the manifests at the images in one place:
#   (cd <your kustomization> && kustomize edit set image ghcr.io/topodra/topodra-node-agent=${REGISTRY}/topodra-node-agent:${tag})
set -o errexit -o nounset -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
manifest_tag=$(sed -n 's/^ *newTag: *//p' "${root}/manifests/base/kustomization.yaml" | head -n 1)
if [[ -z "${VERSION:-}" ]]; then
    if described=$(git -C "${root}" describe --tags --always --dirty 2>/dev/null) && [[ -n "${described}" ]]; then
        # A docker tag allows [A-Za-z0-9_.-] only (a git tag may hold "/").
        version=${described//[^A-Za-z0-9_.-]/-}
    else
        version=${manifest_tag:-v0.1.0-dev}
    fi
else
    version=${VERSION}
fi
registry=${REGISTRY:-ghcr.io/topodra}
docker=${DOCKER:-docker}

if [[ "${version}" == *-dirty ]]; then
    echo "warning: the checkout has uncommitted changes; the tag ${version} names whatever is built from a changed tree, so a node that already pulled it keeps its image: commit, or set VERSION to a tag never pushed before" >&2
fi
for target in scheduler node-agent; do
    image="${registry}/topodra-${target}:${version}"
    echo "building ${image}" >&2
    "${docker}" build --target "${target}" --build-arg VERSION="${version}" -t "${image}" "$@" "${root}" >&2
done
echo "built ${registry}/topodra-scheduler:${version} (with /topodra-check) and ${registry}/topodra-node-agent:${version}" >&2
if [[ "${registry}" != ghcr.io/topodra || "${version}" != "${manifest_tag}" ]]; then
    echo "push the images, then point an overlay (or your own kustomization) at them:" >&2
    for target in scheduler node-agent; do
        echo "  kustomize edit set image ghcr.io/topodra/topodra-${target}=${registry}/topodra-${target}:${version}" >&2
    done
fi
# The tag, alone on stdout.
echo "${version}"
