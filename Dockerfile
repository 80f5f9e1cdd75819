# Multi-stage build of the topodra images:
#   docker build --target scheduler  --build-arg VERSION=v0.1.0 -t ghcr.io/topodra/topodra-scheduler:v0.1.0 .
#   docker build --target node-agent --build-arg VERSION=v0.1.0 -t ghcr.io/topodra/topodra-node-agent:v0.1.0 .
# The scheduler image also holds /topodra-check, the allocation invariant
# checker (static, like the scheduler), which the CronJob of
# manifests/components/invariant-check runs: no third image to build,
# push and keep at the scheduler's tag.
#
# Bases are pinned by release; pin them by digest (image@sha256:...) with
# --build-arg for reproducible release builds. The agent's build and runtime
# bases must share the Debian release: the agent is linked against glibc
# and loads the node's libnvidia-ml.so.1, which needs glibc too.
ARG GO_IMAGE=golang:1.26-bookworm
ARG AGENT_BASE_IMAGE=debian:bookworm-slim
ARG SCHEDULER_BASE_IMAGE=gcr.io/distroless/static-debian12:nonroot

FROM ${GO_IMAGE} AS build
ARG VERSION=v0.1.0-dev
ARG K8S_VERSION=v1.37.2
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ENV LDFLAGS="-X github.com/topodra/topodra/pkg/version.Version=${VERSION} -X k8s.io/component-base/version.gitVersion=${K8S_VERSION} -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37"
RUN CGO_ENABLED=0 go build -trimpath -ldflags "${LDFLAGS}" -o /out/topodra-scheduler ./cmd/scheduler
RUN CGO_ENABLED=0 go build -trimpath -ldflags "${LDFLAGS}" -o /out/topodra-check ./cmd/topodra-check
# The agent loads libnvidia-ml through dlopen (go-nvml), so it needs cgo and
# glibc. The library itself is not in the image: the agent finds it below
# --container-driver-root (the node's driver root, mounted by the DaemonSet).
RUN CGO_ENABLED=1 CGO_CFLAGS=-Wno-deprecated-declarations go build -trimpath -ldflags "${LDFLAGS}" -o /out/topodra-node-agent ./cmd/node-agent

FROM ${SCHEDULER_BASE_IMAGE} AS scheduler
COPY --from=build /out/topodra-scheduler /topodra-scheduler
COPY --from=build /out/topodra-check /topodra-check
ENTRYPOINT ["/topodra-scheduler"]

FROM ${AGENT_BASE_IMAGE} AS node-agent
COPY --from=build /out/topodra-node-agent /topodra-node-agent
ENTRYPOINT ["/topodra-node-agent"]
