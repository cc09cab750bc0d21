"""The services' settings, declared once each as the engine's are (engine/config/utils.py): a dataclass per group
of flags. A `...Config` is a group that several commands take (described once in docs/flags.md); a `...Flags` is
one command's own. Each command's parser is built from them, and its code reads the parsed Namespace."""

import os
from dataclasses import dataclass

from engine.config import DEFAULT_MODEL
from engine.config.utils import setting
from mesh.grpc_policy import MAX_MESSAGE_BYTES
from services.routing import ROUTING_POLICIES

# Each service's own port, so the mesh runs on one machine with every default.
DEFAULT_PORTS = {
    "engine": 50051,
    "tokenizer": 50052,
    "detokenizer": 50053,
    "kvstore": 50054,
    "sampler": 50055,
    "gateway": 8000,
}
DEFAULT_ADDRESS = f"127.0.0.1:{DEFAULT_PORTS['gateway']}"  # where the clients find the gateway
MAX_ENGINES = 64  # engine replicas `llmmesh serve --engines` starts at most


# ---- every service ----------------------------------------------------------------------------------


@dataclass
class ServerConfig:
    """The flags every service has: where it listens, how long it drains, what it logs."""

    host: str = setting("127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    # Each command sets its service's own (DEFAULT_PORTS).
    port: int | None = setting(None, help="0: any free port")
    shutdown_timeout: float = setting(30.0, help="seconds in-flight calls get to finish after SIGTERM")
    log_level: str = setting("INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"), help="the lowest level logged")
    tls_dir: str | None = setting(
        None,
        help="the mesh's credentials (`llmmesh certs` makes them): its CA's certificate, this service's certificate "
        "and key; every gRPC link is mutual TLS, and a peer must hold a certificate of this CA whose identity may "
        "call the service (docs/security.md); unset: tls/ in the state directory ($LLMMESH_STATE_DIR, else "
        "$XDG_STATE_HOME/llmmesh, else ~/.local/state/llmmesh)",
    )
    insecure_plaintext: bool = setting(
        False,
        help="no TLS and no peer identities, for development on one machine: binds loopback only, and reaches the "
        "other services in plaintext",
    )
    max_concurrent_rpcs: int = setting(
        4096, help="calls the server runs at once (gRPC's maximum_concurrent_rpcs); past it RESOURCE_EXHAUSTED"
    )


@dataclass
class UnixSocketConfig:
    """The services behind the gateway (not the gateway, whose clients are not of its host)."""

    unix_socket: str | None = setting(
        None,
        help="also serve on this Unix socket, for the services of this host: the same mutual TLS as the port, in a "
        "directory that must be this user's and private to it (mode 0700); `llmmesh serve` gives one to each "
        "service behind the gateway",
    )


@dataclass
class ObservabilityConfig:
    """Every service's traces (OpenTelemetry, over OTLP) and Prometheus metrics."""

    # Read when the parser is built, so a variable set by then counts.
    otlp_traces_endpoint: str | None = setting(
        default_factory=lambda: os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"),
        help="export traces over OTLP/gRPC to this collector (HOST:PORT or http://HOST:PORT); default "
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing",
    )
    trace_sample_ratio: float = setting(
        1.0, help="the fraction of requests traced (0..1) when the caller sent no sampled traceparent"
    )
    metrics_port: int | None = setting(
        None, help="serve Prometheus /metrics on this port (0: any free port); off when unset"
    )


# ---- the engine ---------------------------------------------------------------------------------------


@dataclass
class EngineObservabilityConfig:
    """What the engine adds to request traces (`llmmesh serve` passes it on to its engines)."""

    collect_detailed_traces: str | None = setting(
        None,
        const="all",
        choices=("all", "model", "worker"),
        help="(vLLM's flag) add each engine step to request traces: the tokens it produced, its batch, its time in "
        "schedule, model and output processing",
    )


@dataclass
class WatchdogConfig:
    """The engine's step watchdog (`llmmesh serve` passes it on to its engines and the first limit to the gateway,
    and acts on the second).

    The defaults are well above the longest step measured: a 2,048-token prefill of SmolLM2-135M, one step, takes
    up to 30 s in float32 on two loaded CPU cores. A larger model on a CPU needs larger limits; 0 turns one off."""

    step_timeout: float = setting(
        120.0,
        help="seconds an engine step may run: past it the engine's health is NOT_SERVING and its requests end "
        "UNAVAILABLE (the gateway moves them to another engine); it serves again if the step then finishes. The "
        "gateway moves the requests of an engine that has failed its health checks for as long (a stopped process)",
    )
    step_timeout_exit: float = setting(
        300.0,
        help="seconds an engine step may run before the engine exits with code 1 (to be restarted); `llmmesh serve` "
        "also kills (SIGKILL) and restarts a service that has not answered its health check for this long",
    )


def check_step_timeouts(step_timeout: float, step_timeout_exit: float) -> None:
    """WatchdogConfig's limits; ValueError naming the flag at fault."""
    for name, value in (("step_timeout", step_timeout), ("step_timeout_exit", step_timeout_exit)):
        if value < 0:
            raise ValueError(f"{name} must be at least 0 (0: off), got {value:g}.")
    if step_timeout and step_timeout_exit and step_timeout_exit <= step_timeout:
        raise ValueError(
            f"step_timeout_exit ({step_timeout_exit:g} s) must be longer than step_timeout ({step_timeout:g} s)."
        )


@dataclass
class EngineFlags:
    vllm_plaintext_port: int | None = setting(
        None,
        help="serve vllm.grpc.engine.VllmEngine also on this port of loopback in plaintext, for a router on this host "
        "that cannot reach a worker over mutual TLS (smg); off when unset",
    )
    lora_vllm_ports: list[str] | None = setting(
        None,
        help="serve each named LoRA adapter also as a model of its own, on vllm.grpc.engine.VllmEngine at PORT, "
        "given as NAME=PORT each (vLLM's protocol names no adapter in a request: a router that picks workers by "
        "model, smg, reaches the adapter there); needs --enable-lora; the adapter may be loaded later, and the "
        "port answers NOT_FOUND while it is not",
    )
    lora_vllm_plaintext_ports: list[str] | None = setting(
        None,
        help="as --lora-vllm-ports, on ports of loopback in plaintext, for a router on this host that cannot reach a "
        "worker over mutual TLS (smg), as --vllm-plaintext-port",
    )


# ---- the text services, the kvstore, the sampler -------------------------------------------------------


@dataclass
class TextModelConfig:
    """The model whose tokenizer the text services serve."""

    model: str = setting(DEFAULT_MODEL, help=f"HF model directory, .gguf file, or {DEFAULT_MODEL}")


@dataclass
class ImageBytesConfig:
    """The gateway's bound on the images a request carries (the tokenizer checks each against its own limits)."""

    max_image_bytes: int = setting(32 * 2**20, help="bytes of encoded images one request may carry, in all")


@dataclass
class LocalMediaConfig:
    """Where a service that preprocesses a vision-language model's images (the tokenizer; the engine, for a
    router's media references) may read image files from besides the request itself."""

    allowed_local_media_path: str = setting(
        "",
        help="a directory whose files (judged on the resolved path) requests may name as images; empty: only images "
        "sent in the request. Nothing is ever fetched from the network",
    )


@dataclass
class MediaConfig(LocalMediaConfig):
    """A vision-language model's images in the tokenizer, which preprocesses them: where it may read them from
    besides the request itself, and how many and how large they may be (the engine's flags of the same names)."""

    limit_mm_per_prompt: int = setting(4, help="images one prompt may carry at most")
    max_image_pixels: int = setting(4096 * 4096, help="pixels (width x height) of one image, at most")


@dataclass
class ChatTemplateConfig:
    """Whether a request may bring its own chat template (the tokenizer, the gateway and `llmmesh serve`)."""

    trust_request_chat_template: bool = setting(
        False,
        help="let requests bring their own chat template: the tokenizer runs it inside its process, the gateway "
        "passes it on to the tokenizer (which must trust it too)",
    )


@dataclass
class KVStoreConfig:
    """The kvstore's flags besides its Redis's address (`llmmesh serve` passes them on to its kvstore)."""

    redis_timeout: float = setting(
        2.0, help="seconds a Redis call or connection may take before the RPC answers UNAVAILABLE"
    )
    max_blocks_per_request: int = setting(
        65536, help="block hashes in one Lookup, Get or Delete, or blocks in one Put message"
    )
    max_block_bytes: int = setting(
        MAX_MESSAGE_BYTES - 2**20,
        help="the largest block a layout may describe (one block travels in one gRPC message)",
    )


@dataclass
class KVStoreFlags:
    redis_url: str = setting(
        "redis://127.0.0.1:6379/0", help="redis://[USER@]HOST:PORT/DB (rediss:// for TLS); no password in it"
    )
    redis_password_file: str | None = setting(
        None, help="a file holding the Redis user's password (`llmmesh certs` writes redis.password)"
    )
    redis_ca_file: str | None = setting(
        None,
        help="with rediss://: the certificate (PEM) of the CA that signed Redis's, trusted besides the system's CAs",
    )
    redis_cert_file: str | None = setting(
        None, help="with rediss://: a client certificate (PEM) to present, for a Redis with tls-auth-clients"
    )
    redis_key_file: str | None = setting(None, help="the key of --redis-cert-file (PEM, unencrypted)")
    redis_allow_plaintext: bool = setting(
        False,
        help="allow redis:// (no TLS) to a host other than loopback: only on a network no one else reaches (compose's "
        "own); otherwise use rediss://",
    )


@dataclass
class SamplerFlags:
    device: str = setting(
        "cpu",
        help="where to sample: cpu, cuda, cuda:1 (seeded draws follow the device's generator: use the engine's "
        "device to reproduce its in-process samples)",
    )
    max_streams: int = setting(64, help="engines' Sample streams open at once; one more gets RESOURCE_EXHAUSTED")
    max_requests_per_stream: int = setting(
        65536,
        help="requests whose sampling state one stream keeps at once; a step that would add more ends the stream "
        "with RESOURCE_EXHAUSTED",
    )
    max_tokens_per_stream: int = setting(
        2**25,
        help="prompt and output tokens one stream keeps, over all its requests (for penalties, min_tokens, bad "
        "words; some 40 bytes each); a step that would keep more ends the stream with RESOURCE_EXHAUSTED",
    )


# ---- the gateway ----------------------------------------------------------------------------------------


@dataclass
class GatewayConfig:
    """The gateway's own flags, not the addresses of its dependencies (`llmmesh serve` takes them too)."""

    served_model_name: str | None = setting(
        None, help="the model name clients may ask for (default: the engines' --model, as in vLLM)"
    )
    max_requests_in_flight: int = setting(1024, help="requests in flight past which new ones get RESOURCE_EXHAUSTED")
    api_key: str | None = setting(
        None,
        help="require metadata 'authorization: Bearer KEY', KEY given only as LLMMESH_API_KEY (on the command line, "
        "where /proc shows it to every local user, it is refused); one tenant, 'default', without rate limits",
    )
    api_keys_file: str | None = setting(
        None,
        help="a JSON or TOML file of the keys the gateway takes, each as its SHA-256 with its tenant and the "
        "tenant's limits (requests_per_second, tokens_per_minute); tenants share no cached prefixes and see no "
        "adapters of one another (docs/deployment.md, Tenants and limits)",
    )
    routing: str | None = setting(
        None,
        choices=ROUTING_POLICIES,
        help="how requests are spread over the engines: prefix-aware (where the prompt's KV blocks are, weighed "
        "against load; the default with more than one engine), least-loaded (fewest in flight) or round-robin",
    )
    routing_log: str | None = setting(
        None,
        help="a file the gateway appends each routing decision to, as a JSON line: the engine chosen, and per "
        "engine the prompt's blocks it holds, those in the KV store, its cost and its load (benchmarks/serve.py "
        "reads it)",
    )
    prefill_timeout: float = setting(
        30.0,
        help="with disaggregated prefill: seconds a prefill engine may take over a prompt before the gateway gives "
        "up on it and the decode engine computes the prompt itself (a hung prefill engine costs a request at most "
        "this; one that fails its health checks is skipped until it passes them again)",
    )
    migration_limit: int = setting(
        3,
        help="times one request may move to another engine when its engine goes away mid-stream (it resumes "
        "there with the tokens already sent); past it the client gets UNAVAILABLE. 0: never",
    )


@dataclass
class GatewayTLSConfig:
    """The gateway's public port (`llmmesh serve` takes them too). Without --tls-cert it serves the mesh's own
    gateway certificate (its CA: ca.crt in --tls-dir)."""

    tls_cert: str | None = setting(None, help="the public port's certificate chain (PEM), for the names clients use")
    tls_key: str | None = setting(None, help="the key of --tls-cert (PEM)")
    tls_ca: str | None = setting(
        None, help="require client certificates signed by this CA (PEM) on the public port; unset: none asked for"
    )


@dataclass
class GatewayFlags:
    engine: list[str] | None = setting(
        None,
        repeatable=True,
        help="an engine address HOST:PORT (repeatable; in the environment, a comma-separated list)",
    )
    prefill_engine: list[str] | None = setting(
        None,
        repeatable=True,
        help="a kv_producer engine's HOST:PORT for disaggregated prefill (repeatable; in the environment, a "
        "comma-separated list): each prompt is computed there and its KV blocks handed through the kvstore to the "
        "--engine engines (kv_consumers), which decode",
    )
    tokenizer: str | None = setting(None, help="the tokenizer service's HOST:PORT")
    detokenizer: str | None = setting(None, help="the detokenizer service's HOST:PORT")


# ---- the mesh: serve and demo ---------------------------------------------------------------------------


@dataclass
class MeshConfig:
    """Which of the mesh's optional parts `llmmesh serve` and `llmmesh demo` run."""

    # Mesh itself (tests, benchmarks) runs the KV store only when asked: Mesh(..., kv_store=True).
    kv_store: bool = setting(
        True, help="run a redis-server and the kvstore, and the engine with its KV connector to them"
    )
    redis_maxmemory: str = setting(
        "2gb", help="the redis-server's maxmemory (it evicts least recently used blocks beyond it)"
    )
    sampler_service: bool = setting(
        True,
        help="run the sampler as its own service, the engine sampling on it (--no-sampler-service: the engine "
        "samples in process)",
    )


@dataclass
class ServeFlags:
    engines: int = setting(
        1,
        help=f"engine replicas behind the gateway (at most {MAX_ENGINES}), sharing the KV store when it runs",
    )
    prefill_engines: int = setting(
        0,
        help="disaggregated prefill (vLLM's P/D): this many kv_producer engines compute each prompt and store its "
        "KV blocks in the KV store, from which the decode engines load them (0: off)",
    )
    decode_engines: int | None = setting(
        None,
        help="with --prefill-engines: the kv_consumer engines that load the prompts' blocks and decode (default 1)",
    )
    prometheus_config: str | None = setting(
        None,
        help="once the mesh is up, write a Prometheus scrape configuration for every service's /metrics to this "
        "file (needs --metrics-port; each service then serves /metrics on a free port)",
    )


@dataclass
class DemoConfig:
    """The demonstrations' generations (`llmmesh run-offline` without --prompt, and `llmmesh demo`)."""

    max_tokens: int = setting(48, help="most tokens to generate per prompt")


@dataclass
class OfflineFlags:
    prompt: list[str] | None = setting(None, repeatable=True, help="a prompt (repeatable); default: built-in demos")
    temperature: float = setting(0.0, help="0: greedy")
    sampling_seed: int | None = setting(None, help="each request's sampling seed; unset: the engine's random state")


# ---- the clients ------------------------------------------------------------------------------------------


@dataclass
class ClientConfig:
    """`llmmesh generate` and `llmmesh chat`: the gateway to call and the request's sampling."""

    address: str = setting(DEFAULT_ADDRESS, help="the gateway's HOST:PORT")
    api_key: str | None = setting(
        None, help="the gateway's key, given only as LLMMESH_API_KEY (on the command line it is refused)"
    )
    tls_ca: str | None = setting(
        None,
        help="the CA that signed the gateway's certificate (PEM); unset: the mesh's ca.crt in LLMMESH_TLS_DIR or "
        "the state directory, which signed the certificate of a gateway without --tls-cert",
    )
    insecure_plaintext: bool = setting(False, help="call a gateway that serves plaintext (on loopback)")
    request_model: str = setting("", flag="--model", help="the model to ask for; empty: the served one")
    max_tokens: int = setting(128, help="most tokens to generate")
    temperature: float | None = setting(None, help="default 1.0; 0: greedy")
    top_p: float | None = setting(None, help="nucleus sampling's probability mass; default 1.0")
    top_k: int | None = setting(None, help="sample from the k likeliest tokens; default: all")
    sampling_seed: int | None = setting(None, help="the request's seed, for repeatable sampling")
    stop: list[str] | None = setting(None, repeatable=True, help="a stop string (repeatable)")
    timeout: float | None = setting(None, help="deadline in seconds")


@dataclass
class GenerateFlags:
    prompt: str = setting(positional=True, help="the prompt's text")


@dataclass
class ChatFlags:
    message: str = setting(positional=True, help="the user's message")
    system: str | None = setting(None, help="a system message to put first")


@dataclass
class CertsFlags:
    dir: str | None = setting(None, help="the credentials directory to fill; unset: tls/ in the state directory")
    host: list[str] | None = setting(
        None,
        repeatable=True,
        help="a further name or IP address of the gateway's public port for its certificate (repeatable)",
    )


@dataclass
class HealthFlags:
    address: str = setting(positional=True, help="HOST:PORT")
    identity: str = setting(
        "engine",
        help="the service at the address (its certificate must name it), whose certificate in --tls-dir the "
        "check presents too",
    )
    tls_dir: str | None = setting(None, help="the mesh's credentials; unset: tls/ in the state directory")
    insecure_plaintext: bool = setting(False, help="check in plaintext")
    service: str = setting("", help="a full service name; empty means the whole server")
    timeout: float = setting(2.0, help="seconds to wait for the answer")
