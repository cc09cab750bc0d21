# One image for every llmmesh service; compose.yaml picks the service with its command.
FROM python:3.11-slim

# redis-server: `llmmesh serve` (the CMD below) runs one for the KV store; compose uses its own Redis container.
# g++: setup builds the C++ CPU attention kernel.
RUN apt-get update -q && apt-get install -y -q --no-install-recommends make g++ redis-server && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
# The same setup as on a development machine: venv, CPU PyTorch, the project, the embedded
# SmolLM2 model and the generated protos. Nothing is downloaded when a container starts.
# CPU PyTorch first (it satisfies the Makefile's torch pin, so setup keeps it).
RUN python -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && make setup
# Convert the embedded GGUF once, at build time, into the image's cache.
ENV LLMMESH_CACHE_DIR=/app/.cache/llmmesh
RUN .venv/bin/python -c "from engine.models.loader import prepare_model_dir; prepare_model_dir('smollm2-135m-instruct')"
ENV PATH=/app/.venv/bin:$PATH
# Every service in a container listens on all its interfaces (the flags' default is loopback); any
# llmmesh flag can be set the same way, as LLMMESH_<FLAG_NAME>.
ENV LLMMESH_HOST=0.0.0.0
EXPOSE 50051
# The whole mesh in one container (`llmmesh serve`, the gateway on 50051); compose.yaml runs one
# service per container instead.
CMD ["llmmesh", "serve", "--port", "50051"]
