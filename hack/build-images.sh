#!/usr/bin/env bash
# build-images.sh: build the topodra-scheduler and topodra-node-agent images
# with the version stamped in (the same ldflags as `make build`).
#   hack/build-images.sh                      # tag: the manifests' (manifests/base/kustomization.yaml)
#   VERSION=v0.2.0 REGISTRY=example.com/me hack/build-images.sh
# Extra arguments go to every `docker build`, e.g. --build-arg GO_IMAGE=golang@sha256:...
# Afterwards, point the manifests at the images in one place:
#   (cd manifests/overlays/<name> && kustomize edit set image ghcr.io/topodra/topodra-node-agent=${REGISTRY}/topodra-node-agent:${VERSION})
set -o errexit -o nounset -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# The manifests' tag by default, so that images built here are the ones
# `kubectl apply -k` names.
manifest_tag=$(sed -n 's/^ *newTag: *//p' "${root}/manifests/base/kustomization.yaml" | head -n 1)
version=${VERSION:-${manifest_tag:-v0.1.0-dev}}
registry=${REGISTRY:-ghcr.io/topodra}
docker=${DOCKER:-docker}

for target in scheduler node-agent; do
    image="${registry}/topodra-${target}:${version}"
    echo "building ${image}" >&2
    "${docker}" build --target "${target}" --build-arg VERSION="${version}" -t "${image}" "$@" "${root}"
done
if [[ "${registry}" != ghcr.io/topodra || "${version}" != "${manifest_tag}" ]]; then
    echo "push the images, then point an overlay at them:" >&2
    for target in scheduler node-agent; do
        echo "  kustomize edit set image ghcr.io/topodra/topodra-${target}=${registry}/topodra-${target}:${version}" >&2
    done
fi
