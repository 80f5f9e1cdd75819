# topodra — thin targets; see README.md.
GO        ?= go
BIN       ?= bin
VERSION   ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo v0.1.0-dev)
K8S_VERSION := v1.37.2
LDFLAGS   := -X github.com/topodra/topodra/pkg/version.Version=$(VERSION) -X k8s.io/component-base/version.gitVersion=$(K8S_VERSION) -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37
# Integration tests start real apiservers; keep package parallelism low on small machines.
# go-nvml is cgo; silence its deprecation warnings.
export CGO_CFLAGS ?= -Wno-deprecated-declarations
TEST_FLAGS ?= -count=1 -timeout=40m -p=2

.PHONY: all build test unit integration test-gpu race verify demo bench bench-short placement fuzz images clean

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/topodra-scheduler ./cmd/scheduler
	@if ls cmd/node-agent/*.go >/dev/null 2>&1; then $(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/topodra-node-agent ./cmd/node-agent; fi
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/topodra-check ./cmd/topodra-check
	@if ls cmd/simulator/*.go >/dev/null 2>&1; then $(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/topodra-sim ./cmd/simulator; fi

# What CI runs: unit, integration and load tests, the concurrent code
# under the race detector, then each fuzz target for 100 executions (a
# count, not a time: an input still running when a fuzz time runs out
# fails the target; the instrumented builds take minutes the first time).
test:
	$(GO) test $(TEST_FLAGS) ./...
	$(MAKE) race
	$(MAKE) fuzz FUZZTIME=100x

# The code that runs concurrently, under the race detector: the plugin
# (Filter runs for many nodes at once, beside informer handlers), the
# checker, and the agent's tests of calls that run at once (the kubelet's
# Prepares and Unprepares, the stale-claim check, claim locks).
race:
	$(GO) test -race $(TEST_FLAGS) ./pkg/plugins/topologydra/ ./pkg/invariant/
	$(GO) test -race $(TEST_FLAGS) -run 'Concurrent|Lock|Stale|Busy' ./pkg/agent/

unit:
	$(GO) test $(TEST_FLAGS) ./pkg/... ./cmd/...

integration:
	$(GO) test $(TEST_FLAGS) ./test/integration/...

# On a GPU node: the checks against the real NVML library of DRIVER_ROOT
# (default /; /run/nvidia/driver on a GPU Operator node), verbose. Where
# there is no GPU they skip, saying why (the dry run's test checks that it
# says so); every go test runs them too.
test-gpu:
	$(GO) test -count=1 -v -run 'RealNVML|RealGPU' ./cmd/node-agent ./pkg/agent/discovery ./test/integration

# Each fuzz target for FUZZTIME (their seed corpora run in every go test).
# The first run instruments and compiles the scheduler's packages: minutes.
FUZZTIME ?= 10s
fuzz:
	$(GO) test -run XXX -fuzz FuzzTopologyAttributes -fuzztime $(FUZZTIME) ./pkg/topology
	$(GO) test -run XXX -fuzz FuzzWorkloadYAML -fuzztime $(FUZZTIME) ./pkg/sim/workload
	$(GO) test -run XXX -fuzz FuzzArgsDecode -fuzztime $(FUZZTIME) ./pkg/plugins/topologydra
	$(GO) test -run XXX -fuzz FuzzAllocatorInput -fuzztime $(FUZZTIME) ./pkg/allocator

# Container images of the scheduler and the node agent (docker).
images:
	hack/build-images.sh

# logcheck: Kubernetes' checker of structured, contextual logging calls
# (fetched from the Go module proxy on first use).
LOGCHECK ?= sigs.k8s.io/logtools/logcheck@v0.11.0
verify:
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	$(GO) run $(LOGCHECK) -check-contextual -config hack/logcheck.conf ./...

demo:
	$(GO) run ./cmd/simulator $(DEMO_ARGS)

bench:
	$(GO) run ./test/perf/cmd $(if $(BENCH_OUT),--out $(BENCH_OUT))

bench-short:
	$(GO) run ./test/perf/cmd --short $(if $(BENCH_OUT),--out $(BENCH_OUT))

clean:
	rm -rf $(BIN) _out

# Placement verdict: every scenario with seeds 1-8 through topodra and stock;
# one row per run, then medians against the placement targets (docs/placement.md).
# PLACEMENT_ROUNDS=3 runs everything three times and takes the medians over all.
PLACEMENT_SEEDS ?= 1-8
PLACEMENT_ROUNDS ?= 1
placement:
	@mkdir -p _out
	$(GO) run ./cmd/simulator --seeds $(PLACEMENT_SEEDS) --rounds $(PLACEMENT_ROUNDS) --json $(or $(PLACEMENT_OUT),_out/placement.json) $(PLACEMENT_ARGS)
