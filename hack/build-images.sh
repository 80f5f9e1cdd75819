#!/usr/bin/env bash
# build-images.sh: build the topodra-scheduler and topodra-node-agent images
# with the version stamped in (the same ldflags as `make build`).
#   hack/build-images.sh                      # tag: git describe
#   VERSION=v0.2.0 REGISTRY=example.com/me hack/build-images.sh
# Extra arguments go to every `docker build`, e.g. --build-arg GO_IMAGE=golang@sha256:...
# Afterwards, point the manifests at the images in one place:
#   (cd manifests/overlays/<name> && kustomize edit set image ghcr.io/topodra/topodra-node-agent=${REGISTRY}/topodra-node-agent:${VERSION})
set -o errexit -o nounset -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
version=${VERSION:-$(git -C "${root}" describe --tags --always --dirty 2>/dev/null || echo v0.1.0-dev)}
registry=${REGISTRY:-ghcr.io/topodra}
docker=${DOCKER:-docker}

for target in scheduler node-agent; do
    image="${registry}/topodra-${target}:${version}"
    echo "building ${image}" >&2
    "${docker}" build --target "${target}" --build-arg VERSION="${version}" -t "${image}" "$@" "${root}"
done
