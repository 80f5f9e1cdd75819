# Multi-stage build of the topodra binaries:
#   docker build --target scheduler -t topodra-scheduler .
#   docker build --target node-agent -t topodra-node-agent .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN CGO_ENABLED=0 go build -o /src/bin/topodra-scheduler ./cmd/scheduler

FROM gcr.io/distroless/static:nonroot AS scheduler
COPY --from=build /src/bin/topodra-scheduler /topodra-scheduler
ENTRYPOINT ["/topodra-scheduler"]

# The agent loads libnvidia-ml through dlopen, so it needs glibc and cgo.
FROM golang:1.26 AS build-agent
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
RUN go build -o /topodra-node-agent ./cmd/node-agent

FROM debian:bookworm-slim AS node-agent
COPY --from=build-agent /topodra-node-agent /topodra-node-agent
ENTRYPOINT ["/topodra-node-agent"]
