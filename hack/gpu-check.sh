#!/usr/bin/env bash
# gpu-check.sh: build topodra-node-agent and show the ResourceSlice it would
# publish for this machine's NVIDIA GPUs, discovered through the real NVML
# library (loaded from the driver root) and /sys. Then the agent prepares a
# claim for all of them with its own Prepare (CDI edits from nvcdi over the
# driver root) in a temporary checkpoint and CDI directory, prints the CDI
# spec it wrote and what a container of the claim sees once the CDI library
# applies the claim's devices as a runtime does (environment, driver
# libraries and nvidia-smi mounts, device nodes, hooks), and unprepares it.
# Needs no cluster; builds bin/topodra-node-agent (or $BIN_DIR), and the
# agent writes nothing outside a temporary directory. Extra
# arguments go to the agent, e.g.
#   hack/gpu-check.sh --owned-taint --numa-list
#   DRIVER_ROOT=/run/nvidia/driver hack/gpu-check.sh   # GPU Operator node
#   DRIVER_ROOT=auto hack/gpu-check.sh                 # whichever holds libnvidia-ml.so.1
#
# Exits 0 with "no NVIDIA GPU here: <reason>" where there is no GPU (no
# libnvidia-ml.so, no kernel driver, or zero devices); any other failure is
# an error.
set -o errexit -o nounset -o pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin_dir=${BIN_DIR:-"${root}/bin"}
bin="${bin_dir}/topodra-node-agent"

mkdir -p "${bin_dir}"
echo "building ${bin}" >&2
# go-nvml's cgo bindings use NVML functions that NVML 13 deprecates.
(cd "${root}" && CGO_CFLAGS="${CGO_CFLAGS:--Wno-deprecated-declarations}" go build -o "${bin}" ./cmd/node-agent)

if command -v nvidia-smi >/dev/null 2>&1; then
    echo "nvidia-smi sees:" >&2
    nvidia-smi -L >&2 || true
    nvidia-smi topo -m >&2 || true
fi

node=${NODE_NAME:-$(hostname)}
echo "discovering GPUs of node ${node} through real NVML" >&2
driver_root=${DRIVER_ROOT:-/}
echo "driver root ${driver_root}" >&2
exec "${bin}" --dry-run --show-cdi --nvml=real --driver-root="${driver_root}" --node-name="${node}" "$@"
