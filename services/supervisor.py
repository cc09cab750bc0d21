"""`llmmesh serve`: the mesh on one machine (services/local_mesh.py), started, watched and stopped.

serve starts the engine, tokenizer, detokenizer and gateway as separate processes on loopback, with the mesh's
credentials from --tls-dir (made there on first start: services/certs.py), waits until the gateway reports every
service healthy, prints the gateway's address and stops everything on Ctrl-C or SIGTERM.
A service that dies is started again on its port (supervise); one that keeps dying stops the mesh. `llmmesh demo`
does the same, streams a few generations through it and stops.
"""

import argparse
import dataclasses
import os
import signal
import sys
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import EngineArgs
from engine.config.utils import add_cli_args
from engine.limits import RequestLimits
from mesh import tls
from services import client, config, kvstore_service
from services.gateway import add_gateway_args
from services.local_mesh import REDIS, Mesh
from services.prometheus import scrape_config
from services.service_process import ServiceProcess, exit_status
from services.settings import (
    MAX_ENGINES,
    DemoConfig,
    LocalMediaConfig,
    MeshConfig,
    ServeFlags,
    WatchdogConfig,
    check_step_timeouts,
)
from services.tenants import refuse_key_on_command_line

# `llmmesh serve` starts a service that died again after RESTART_BACKOFF_S, doubled for each time it was restarted
# in the last RESTART_WINDOW_S. A service that dies once more after MAX_RESTARTS restarts in that window is in a
# crash loop: serve stops the mesh and says so. The window is long enough to hold five deaths of an engine that
# fails each time after loading for a minute.
RESTART_BACKOFF_S = 0.25
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
# serve checks each service's gRPC health every HEALTH_INTERVAL_S, a check failing unless answered within
# HEALTH_TIMEOUT_S (an engine's event loop answers between the GIL-holding parts of a step).
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 5.0


def serve(args: argparse.Namespace) -> None:
    refuse_key_on_command_line(args)
    if args.prometheus_config and args.metrics_port is None:
        raise ValueError("--prometheus-config needs --metrics-port (0: each service on a free port of its own)")
    if not 1 <= args.engines <= MAX_ENGINES:
        raise ValueError(f"--engines must be from 1 to {MAX_ENGINES}, got {args.engines}.")
    if args.insecure_plaintext:
        tls.check_plaintext_host(args.host)  # before anything starts
    check_step_timeouts(args.step_timeout, args.step_timeout_exit)
    mesh = serve_mesh(args)
    num_engines = len(mesh.engine_names)
    engine_args = mesh.engine_args
    stop, started = threading.Event(), threading.Event()

    def on_signal(*_):
        stop.set()
        if not started.is_set():
            raise KeyboardInterrupt  # still starting: Mesh.start stops what it started

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    health = HealthWatch(mesh, stop)
    began = time.perf_counter()
    store = (", Redis, the kvstore" if mesh.kv_store else "") + (", the sampler" if mesh.sampler else "")
    engines = "the engine" if num_engines == 1 else f"{num_engines} engines"
    if args.prefill_engines:
        engines = f"{args.prefill_engines} prefill and {num_engines} decode engines"
    say(f"starting {engines}, the tokenizer, detokenizer{store} and gateway for {engine_args.model}")
    try:
        try:
            address = mesh.start()
            started.set()
        except KeyboardInterrupt:
            return
        say(f"every service is healthy after {time.perf_counter() - began:.1f} s")
        for name in [REDIS] * (mesh.redis is not None) + list(mesh.services):
            say(f"the {name} is serving: {describe(mesh, name)}")
        if args.prometheus_config:
            write_prometheus_config(mesh, args.prometheus_config)
        print(f"llmmesh gateway listening on {address}", flush=True)
        own_ca = not (args.insecure_plaintext or args.tls_cert)  # the mesh's CA signed the gateway's certificate
        ca = f" --tls-ca {os.path.join(args.tls_dir, 'ca.crt')}" if own_ca else ""
        print(f'  try: llmmesh generate "The capital of France is" --address {address}{ca}', flush=True)
        health.start()
        crash_loop = supervise(mesh, stop, health=health, unanswered_limit=args.step_timeout_exit)
        if crash_loop:
            say(crash_loop, error=True)
            sys.exit(1)
    finally:
        stop.set()  # ends the health checks
        say("stopping")
        mesh.stop(args.shutdown_timeout)
        say("stopped")


def serve_mesh(args: argparse.Namespace, echo: bool = True) -> Mesh:
    """The mesh, not yet started, that `llmmesh serve` runs for its flags (benchmarks/serve.py measures this one)."""
    args.tls_dir = args.tls_dir or tls.default_tls_dir()
    num_engines = disaggregated_engines(args)
    flags = service_flags(args)
    return Mesh(
        EngineArgs.from_cli_args(args),
        flags.pop("gateway"),
        port=args.port,
        echo=echo,
        num_engines=num_engines,
        prefill_engines=args.prefill_engines,
        **kv_store_options(args),
        **sampler_options(args),
        env=telemetry_env(args),
        service_args=flags,
        kv_connector_options=migration_kv_options(args, num_engines),
        tls_dir=args.tls_dir,
        insecure_plaintext=args.insecure_plaintext,
        unix_sockets=True,  # every service on this host: the gateway's hot links skip TCP (docs/security.md)
    )


def say(message: str, error: bool = False) -> None:
    print(f"llmmesh serve: {message}", file=sys.stderr if error else sys.stdout, flush=True)


def describe(mesh: Mesh, name: str) -> str:
    """Where a process of the mesh serves, and its pid."""
    if name == REDIS:
        return f"{mesh.redis.address} (pid {mesh.popen(name).pid})"
    process = mesh.services[name]
    metrics = f", /metrics at {process.metrics_address}" if process.metrics_address else ""
    return f"{process.address} (pid {process.popen.pid}{metrics})"


def restart_backoff(restarts: list[float], now: float) -> float | None:
    """Seconds to wait before starting a process that died again, given when it was restarted before; None when
    it was restarted MAX_RESTARTS times within the last RESTART_WINDOW_S (a crash loop)."""
    recent = [t for t in restarts if now - t < RESTART_WINDOW_S]
    return None if len(recent) >= MAX_RESTARTS else RESTART_BACKOFF_S * 2 ** len(recent)


class HealthWatch:
    """Each service's gRPC health, checked from a thread of its own every HEALTH_INTERVAL_S until stop is set. A
    process that stopped (SIGSTOP) freezes the watchdog inside it too: from outside, it answers nothing. An answer
    counts whatever its status: NOT_SERVING is the service's own account (a gateway waiting for its engine, an
    engine draining or stuck, which exits on its own), which no restart would mend."""

    def __init__(self, mesh: Mesh, stop: threading.Event):
        self.mesh, self.stop = mesh, stop
        self.answered: dict[str, tuple[ServiceProcess, float]] = {}  # name -> (its process, when it last answered)

    def start(self) -> None:
        for name in self.mesh.services:
            threading.Thread(target=self._watch, args=(name,), name=f"{name}-health", daemon=True).start()

    def _watch(self, name: str) -> None:
        # One channel to each process, kept open: a new one per check would cost a TLS handshake on both sides every
        # second, time the engine's forward pass shares its two cores with.
        channel, for_process = None, None
        while not self.stop.wait(HEALTH_INTERVAL_S):
            process = self.mesh.services[name]
            if not process.listening.is_set() or not process.alive():
                continue  # starting, or dead: supervise's to handle
            if for_process is not process:
                if channel is not None:
                    channel.close()
                channel = tls.channel(process.address, process.service, self.credentials(process.service))
                for_process = process
                self.answered[name] = (process, time.monotonic())  # the clock starts when it began to serve
            if answers_health(channel, HEALTH_TIMEOUT_S):
                self.answered[name] = (process, time.monotonic())
        if channel is not None:
            channel.close()

    def credentials(self, service: str) -> tls.MeshCredentials | None:
        """A service's own certificate, which its health service answers (None under plaintext)."""
        return None if self.mesh.insecure_plaintext else tls.MeshCredentials(self.mesh.tls_dir, service)

    def unanswered(self, name: str, now: float) -> float:
        """Seconds since the service's current process last answered (0 until it began to serve)."""
        process, when = self.answered.get(name, (None, now))
        return now - when if process is self.mesh.services[name] else 0.0


def answers_health(channel: grpc.Channel, timeout: float) -> bool:
    """Whether the server behind channel answers a health check within timeout, SERVING or not."""
    try:
        health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return True


def supervise(
    mesh: Mesh,
    stop: threading.Event,
    poll_s: float = 0.1,
    health: HealthWatch | None = None,
    unanswered_limit: float = 0.0,
) -> str | None:
    """Start every process of the mesh that dies again, on its ports, after restart_backoff, until stop is set; kill
    (SIGKILL) one that has answered none of health's checks for unanswered_limit s (0: never), to start it again.
    Returns why it gave up instead: a process in a crash loop."""
    restarts: dict[str, list[float]] = {}  # name -> when it was started again, in the last RESTART_WINDOW_S
    due: dict[str, float] = {}  # a dead process -> when to start it again
    starting: set[str] = set()  # started again, not serving yet
    while not stop.wait(poll_s):
        now = time.monotonic()
        if health is not None and unanswered_limit:
            for name, process in mesh.services.items():
                silent = health.unanswered(name, now)
                if silent > unanswered_limit and process.alive():
                    say(
                        f"the {name} (pid {process.popen.pid}) has answered no health check for {silent:.0f} s, "
                        f"past --step-timeout-exit ({unanswered_limit:g} s): killing it",
                        error=True,
                    )
                    process.kill()
        for name in mesh.dead():
            if name in due:
                continue
            starting.discard(name)
            restarts[name] = [t for t in restarts.get(name, []) if now - t < RESTART_WINDOW_S]
            status = exit_status(mesh.popen(name).returncode)
            backoff = restart_backoff(restarts[name], now)
            if backoff is None:
                return (
                    f"the {name} exited ({status}) after {MAX_RESTARTS} restarts within {RESTART_WINDOW_S:g} s, "
                    f"the most serve allows: a crash loop, so the mesh stops; the {name}'s output above says why"
                )
            due[name] = now + backoff
            say(f"the {name} exited ({status}); starting it again in {backoff:g} s", error=True)
        for name in [name for name, at in due.items() if at <= now]:
            del due[name]
            restarts[name].append(now)
            try:
                mesh.relaunch(name)
            except (RuntimeError, TimeoutError) as e:  # Redis that did not come back: dead again, seen next time
                say(f"the {name} did not start again: {e}", error=True)
                continue
            say(f"started the {name} again (pid {mesh.popen(name).pid})")
            starting.add(name)
        for name in [name for name in starting if name == REDIS or mesh.services[name].listening.is_set()]:
            starting.discard(name)
            say(f"the {name} is serving again: {describe(mesh, name)}")
    return None


def write_prometheus_config(mesh: Mesh, path: str) -> None:
    """A Prometheus scrape configuration for every service's /metrics (they keep their ports when restarted)."""
    targets = {name: process.metrics_address for name, process in mesh.services.items() if process.metrics_address}
    with open(path, "w") as f:
        f.write(scrape_config(targets))
    say(
        f"wrote a Prometheus scrape configuration for {len(targets)} services to {os.path.abspath(path)} "
        f"(prometheus --config.file {path})"
    )


DEMO_PROMPTS = ["The capital of France is", "def quicksort(items):", "Three facts about the Moon:"]
DEMO_CHAT = [{"role": "user", "content": "Write a haiku about paged memory."}]


def run_demo(args: argparse.Namespace) -> None:
    """Start the mesh, stream a few greedy generations and a chat through the gateway, stop it."""
    started = time.perf_counter()
    with Mesh(EngineArgs.from_cli_args(args), **kv_store_options(args), **sampler_options(args)) as mesh:
        print(f"mesh up in {time.perf_counter() - started:.1f} s, gateway at {mesh.address}", flush=True)
        for prompt in DEMO_PROMPTS:
            print(f"\n>>> {prompt}", flush=True)
            client.print_stream(client.generate(mesh.address, prompt, max_tokens=args.max_tokens, temperature=0.0))
        print(f"\n>>> chat: {DEMO_CHAT[0]['content']}", flush=True)
        client.print_stream(client.chat(mesh.address, DEMO_CHAT, max_tokens=args.max_tokens, temperature=0.0))
    print("\nmesh stopped", flush=True)


def telemetry_env(args: argparse.Namespace) -> dict:
    """`llmmesh serve --otlp-traces-endpoint/--trace-sample-ratio` for every service it starts (--metrics-port:
    each service on a free port of its own, printed as `llmmesh <service> metrics on HOST:PORT`)."""
    env = {"LLMMESH_TRACE_SAMPLE_RATIO": str(args.trace_sample_ratio)}
    if args.otlp_traces_endpoint:
        env["LLMMESH_OTLP_TRACES_ENDPOINT"] = args.otlp_traces_endpoint
    if args.metrics_port is not None:
        env["LLMMESH_METRICS_PORT"] = "0"
    return env


def disaggregated_engines(args: argparse.Namespace) -> int:
    """Check --prefill-engines and --decode-engines; the engines behind the gateway's routing (the decode ones with
    disaggregated prefill)."""
    if args.prefill_engines == 0:
        if args.decode_engines is not None:
            raise ValueError("--decode-engines needs --prefill-engines (without them, --engines sets the replicas).")
        return args.engines
    if not 1 <= args.prefill_engines <= MAX_ENGINES:
        raise ValueError(f"--prefill-engines must be from 0 to {MAX_ENGINES}, got {args.prefill_engines}.")
    if args.engines != 1:
        raise ValueError("with --prefill-engines, give the decode engines' count as --decode-engines, not --engines.")
    decode = 1 if args.decode_engines is None else args.decode_engines
    if not 1 <= decode <= MAX_ENGINES:
        raise ValueError(f"--decode-engines must be from 1 to {MAX_ENGINES}, got {decode}.")
    if not args.kv_store:
        raise ValueError(
            "--prefill-engines hand their KV blocks to the decode engines through the KV store: drop --no-kv-store."
        )
    return decode


def migration_kv_options(args: argparse.Namespace, num_engines: int) -> dict:
    """With more than one engine and the KV store, each engine stores its requests' generated tokens' full blocks
    too (store_decode_blocks), so that a request that migrates loads them on its new engine, not recomputes them."""
    if num_engines > 1 and args.kv_store and args.migration_limit > 0:
        return {"store_decode_blocks": True}
    return {}


def as_flags(args: argparse.Namespace, dests) -> list[str]:
    """`--name value` for each dest, as args holds it."""
    return [flag for dest in dests for flag in ("--" + dest.replace("_", "-"), str(getattr(args, dest)))]


def service_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """`llmmesh serve`'s flags for each service that takes them, by service. The engine's own (EngineArgs) go to it
    as Mesh's engine_args, --model also to the text services, and tracing and metrics as telemetry_env; the
    gateway alone binds --host and --port, the others listen on loopback."""
    every = ["--log-level", args.log_level, "--max-concurrent-rpcs", str(args.max_concurrent_rpcs)]
    every += ["--tls-dir", args.tls_dir] if args.tls_dir else []
    every += ["--insecure-plaintext"] if args.insecure_plaintext else []
    drain = ["--shutdown-timeout", str(args.shutdown_timeout)]
    limits = as_flags(args, [f.name for f in dataclasses.fields(RequestLimits)])
    store = as_flags(args, ("redis_timeout", "max_blocks_per_request", "max_block_bytes"))
    trust = ["--trust-request-chat-template"] if args.trust_request_chat_template else []
    # Where image files may be read from: the tokenizer preprocesses the gateway's images, the engine a router's.
    media_root = as_flags(args, ("allowed_local_media_path",))
    # The engine's own image limits (EngineArgs) hold in the tokenizer too, which decodes the images first.
    images = media_root + as_flags(args, ("limit_mm_per_prompt", "max_image_pixels"))
    gateway = ["--host", args.host, "--max-requests-in-flight", str(args.max_requests_in_flight)]
    gateway += ["--prefill-timeout", str(args.prefill_timeout), "--migration-limit", str(args.migration_limit)]
    gateway += as_flags(args, ("step_timeout",))
    gateway += as_flags(args, ("max_image_bytes",))
    if args.served_model_name:
        gateway += ["--served-model-name", args.served_model_name]
    # A key stays off the command lines: the gateway inherits LLMMESH_API_KEY from this process.
    if args.api_keys_file:
        gateway += ["--api-keys-file", args.api_keys_file]
    if args.routing:
        gateway += ["--routing", args.routing]
    if args.routing_log:
        gateway += ["--routing-log", args.routing_log]
    for flag in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(args, flag):
            gateway += ["--" + flag.replace("_", "-"), getattr(args, flag)]
    engine = as_flags(args, [f.name for f in dataclasses.fields(WatchdogConfig)])
    if args.collect_detailed_traces:
        engine += ["--collect-detailed-traces", args.collect_detailed_traces]
    # The sampler samples where the engine runs (its seeded draws follow that device's generator) when the engine's
    # device is named; with "auto" it stays on the CPU, its default.
    device = ["--device", args.device] if args.device != "auto" else []
    return {
        "gateway": [*every, *drain, *gateway, *trust, *limits],
        "engine": [*every, *drain, *engine, *media_root, *limits],
        "tokenizer": [*every, *drain, *trust, *images, *limits],
        "detokenizer": [*every, *drain, *limits],
        "kvstore": [*every, *drain, *store],
        "sampler": [*every, *device],  # its short drain stays: an engine's step stream lasts as long as the engine
    }


def add_mesh_args(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, MeshConfig)


def kv_store_options(args: argparse.Namespace) -> dict:
    """Mesh's KV-store arguments as serve or demo was given them."""
    return {"kv_store": args.kv_store, "redis_maxmemory": args.redis_maxmemory}


def sampler_options(args: argparse.Namespace) -> dict:
    return {"sampler": args.sampler_service}


def add_subcommands(subparsers) -> None:
    p = config.service_parser(
        subparsers,
        "serve",
        "run the whole mesh on loopback (one process per service)",
        port_of="gateway",
        unix_socket=False,  # each service gets a socket of its own
    )
    p.description = (
        "Run the whole mesh on loopback, one process per service; each flag reaches every service that takes it. "
        f"A service that dies is started again on its port after {RESTART_BACKOFF_S:g} s, doubled for each restart "
        f"of it in the last {RESTART_WINDOW_S:g} s; one that dies after {MAX_RESTARTS} restarts within "
        f"{RESTART_WINDOW_S:g} s is in a crash loop, and serve stops the mesh and exits with code 1. One that answers "
        "no gRPC health check for --step-timeout-exit s is killed (SIGKILL) and started again."
    )
    add_gateway_args(p)
    add_cli_args(p, ServeFlags, grouped=False)
    add_cli_args(p, WatchdogConfig)
    add_cli_args(p, LocalMediaConfig)
    EngineArgs.add_cli_args(p)
    config.add_detailed_traces_arg(p)
    add_mesh_args(p)
    kvstore_service.add_store_args(p)
    p.set_defaults(func=serve)

    p = subparsers.add_parser("demo", help="start the mesh, stream a few generations through it, stop it")
    EngineArgs.add_cli_args(p)
    add_cli_args(p, DemoConfig)
    add_mesh_args(p)
    p.set_defaults(func=run_demo)
