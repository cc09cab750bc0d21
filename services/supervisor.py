"""The mesh on one machine: services as child processes, started, watched and stopped in order.

`llmmesh serve` starts the engine, tokenizer, detokenizer and gateway as separate processes on loopback
(each on a free port, read from its "listening on" line), waits until the gateway reports every service
healthy, prints the gateway's address and stops everything on Ctrl-C or SIGTERM. `llmmesh demo` does the
same, streams a few generations through it and stops. Tests and benchmarks start services the same way.
With the KV store, a `redis-server` (RedisServer) and the kvstore start first, and the engine is given a
--kv-transfer-config that points its connector at the kvstore.
"""

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from engine.config import EngineArgs
from services import client, config
from services.gateway import add_gateway_args

LISTENING = re.compile(r"llmmesh (\w+) listening on (\S+)")
METRICS = re.compile(r"llmmesh (\w+) metrics on (\S+)")  # with --metrics-port (services.telemetry)


# ---- running services as processes --------------------------------------------------------------


class ServiceProcess:
    """`llmmesh <service> <args>` as a child process; its address comes from its listening line."""

    def __init__(self, service: str, args: list[str], echo: bool = False, env: dict | None = None):
        self.service = service
        self.args = list(args)
        self.address: str | None = None
        self.metrics_address: str | None = None  # HOST:PORT of its Prometheus /metrics, once it says
        self.listening = threading.Event()
        self.echo = echo
        # Its own session: a Ctrl-C at the terminal reaches `serve`, which stops the services in order.
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", service, *args],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
            env=None if env is None else {**os.environ, **env},  # env: variables on top of this process's
        )
        threading.Thread(target=self._read_stdout, name=f"{service}-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        with self.popen.stdout:
            for line in self.popen.stdout:
                match = LISTENING.search(line)
                if match and match.group(1) == self.service and self.address is None:
                    self.address = match.group(2)
                    self.listening.set()
                    continue
                if (metrics := METRICS.search(line)) and metrics.group(1) == self.service:
                    self.metrics_address = metrics.group(2)
                if self.echo:
                    print(f"[{self.service}] {line}", end="", flush=True)

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not self.listening.wait(0.1):
            if self.popen.poll() is not None:
                raise RuntimeError(f"the {self.service} exited with code {self.popen.returncode} before it was serving")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {self.service} was not serving after {timeout:.0f} s")
        return self.address

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the service drains), then SIGKILL after timeout."""
        self.terminate()
        self.wait(timeout)

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        """Wait for the process to exit; SIGKILL it after timeout."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()

    def kill(self) -> None:
        self.popen.kill()
        self.popen.wait()


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before it is used)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """`redis-server` as a child process for the KV store: on 127.0.0.1 only, on a free port (or the one given),
    with a temporary directory of its own, no persistence, and `maxmemory` with allkeys-lru eviction (a cache).

    start() (called on construction) returns once it accepts connections; kill() and start() again bring it
    back on the same port, empty, as a restarted Redis would be."""

    READY = "Ready to accept connections"

    def __init__(self, port: int = 0, maxmemory: str = "2gb", echo: bool = False):
        self.executable = shutil.which("redis-server")
        if self.executable is None:
            raise RuntimeError("redis-server is not installed: `make setup` installs Debian's redis-server when run as "
                               "root (or: apt-get install redis-server), or run without the KV store (--no-kv-store)")
        self.port = port
        self.maxmemory = maxmemory
        self.echo = echo
        self.dir = tempfile.mkdtemp(prefix="llmmesh-redis-")
        self.popen: subprocess.Popen | None = None
        try:
            self.start()
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"redis://{self.address}/0"

    def start(self, timeout: float = 30.0) -> None:
        """Start it (on a free port the first time) and wait until it accepts connections."""
        if self.alive():
            return
        for _ in range(5):
            chosen = self.port or free_port()
            if self._launch(chosen, timeout):
                self.port = chosen
                return
            if self.port:  # a port given, or the one it had: taken
                break
        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port or 'a free port'} (exit code "
                           f"{self.popen.returncode}); run it with echo=True to see its log")

    def _launch(self, port: int, timeout: float) -> bool:
        ready = threading.Event()
        self.popen = subprocess.Popen(
            [self.executable, "--port", str(port), "--bind", "127.0.0.1", "--protected-mode", "yes",
             "--dir", self.dir, "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", "",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        threading.Thread(target=self._read_log, args=(self.popen, ready), name="redis-log", daemon=True).start()
        deadline = time.monotonic() + timeout
        while not ready.wait(0.05):
            if self.popen.poll() is not None:
                return False
            if time.monotonic() > deadline:
                self.kill()
                raise TimeoutError(f"redis-server on 127.0.0.1:{port} was not ready after {timeout:.0f} s")
        return True

    def _read_log(self, popen: subprocess.Popen, ready: threading.Event) -> None:
        with popen.stdout:
            for line in popen.stdout:
                if self.READY in line:
                    ready.set()
                if self.echo:
                    print(f"[redis] {line}", end="", flush=True)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: as if it crashed (its data is gone; start() brings it back on the same port)."""
        if self.alive():
            self.popen.kill()
        if self.popen is not None:
            self.popen.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after timeout), and its directory removed."""
        if self.alive():
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def engine_flags(engine_args: EngineArgs) -> list[str]:
    """EngineArgs back to `llmmesh engine` flags."""
    flags = []
    for f in dataclasses.fields(engine_args):
        value, flag = getattr(engine_args, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def kv_transfer_config(kvstore_address: str, **options) -> str:
    """The engine's --kv-transfer-config (vLLM's form) for a connector to the kvstore at kvstore_address, with
    any further connector options (load_policy, store_decode_blocks, timeouts)."""
    return json.dumps({"kv_connector": "KVStoreConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"kvstore_address": kvstore_address, **options}},
                      separators=(",", ":"))


class Mesh:
    """Engine, tokenizer, detokenizer and gateway processes on loopback; with kv_store, also a redis-server
    and the kvstore, started before the engine, which is given a --kv-transfer-config pointing at the kvstore."""

    def __init__(self, engine_args: EngineArgs, gateway_args: list[str] = (), port: int = 0, echo: bool = False,
                 kv_store: bool = False, redis_maxmemory: str = "2gb", num_engines: int = 1, sampler: bool = False,
                 env: dict | None = None):
        self.engine_args = engine_args
        self.env = env  # variables every service gets on top of this process's (LLMMESH_*, OTEL_*)
        self.gateway_args = list(gateway_args)
        self.port = port
        self.echo = echo
        self.kv_store = kv_store
        self.redis_maxmemory = redis_maxmemory
        self.redis: RedisServer | None = None
        self.sampler = sampler  # a sampler service (started before the engines, which sample on it)
        # "engine", then "engine-2"...: replicas behind the one gateway (sharing the KV store, when there is one)
        self.engine_names = ["engine"] + [f"engine-{i}" for i in range(2, num_engines + 1)]
        self.services: dict[str, ServiceProcess] = {}

    def start(self, timeout: float = 600.0) -> str:
        """Start everything and wait until the gateway is serving; returns the gateway's address."""
        self.launch()
        return self.wait(timeout)

    def launch(self, timeout: float = 60.0) -> None:
        """Start the engine, tokenizer and detokenizer (they load at the same time), after Redis and the kvstore
        when the KV store is on; wait() finishes the job."""
        engine_args = self.engine_args
        try:
            if self.kv_store:
                self.redis = RedisServer(maxmemory=self.redis_maxmemory, echo=self.echo)
                kvstore = self._start("kvstore", ["--port", "0", "--redis-url", self.redis.url])
                engine_args = dataclasses.replace(engine_args, kv_transfer_config=kv_transfer_config(
                    kvstore.wait_listening(timeout)))
            if self.sampler:
                sampler = self._start("sampler", ["--port", "0"])
                engine_args = dataclasses.replace(engine_args, sampler_address=sampler.wait_listening(timeout))
        except BaseException:
            self.stop()
            raise
        model = ["--model", engine_args.model]
        for name in self.engine_names:
            self._start(name, ["--port", "0", *engine_flags(engine_args)], service="engine")
        self._start("tokenizer", ["--port", "0", *model])
        self._start("detokenizer", ["--port", "0", *model])

    def wait(self, timeout: float = 600.0) -> str:
        """Wait for the services, then start the gateway in front of them and wait until it is serving."""
        try:
            for name in (*self.engine_names, "tokenizer", "detokenizer"):
                self.services[name].wait_listening(timeout)
            self._start("gateway", ["--port", str(self.port), *self.gateway_args, *self.backend_flags()])
            return self.services["gateway"].wait_listening(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str], service: str | None = None) -> ServiceProcess:
        self.services[name] = ServiceProcess(service or name, args, self.echo, self.env)
        return self.services[name]

    def backend_flags(self) -> list[str]:
        """The gateway flags that point at this mesh's engines, tokenizer and detokenizer."""
        return [flag for name in (*self.engine_names, "tokenizer", "detokenizer")
                for flag in (f"--{self.services[name].service}", self.services[name].address)]

    def start_gateway(self, args: list[str], timeout: float = 60.0) -> ServiceProcess:
        """Another gateway (on a free port) in front of the same services, e.g. with other flags."""
        process = ServiceProcess("gateway", ["--port", "0", *args, *self.backend_flags()], self.echo, self.env)
        process.wait_listening(timeout)
        return process

    def restart(self, name: str, timeout: float = 120.0) -> ServiceProcess:
        """Start a service again with its flags, on the port it had (after it died or was killed)."""
        old = self.services[name]
        if old.alive():
            old.kill()
        self._start(name, [*old.args, "--port", str(old.port)], service=old.service)  # the last --port wins
        self.services[name].wait_listening(timeout)
        return self.services[name]

    def revive_store(self) -> list[str]:
        """Start a Redis or kvstore that died again, on its port (the store is a cache: meanwhile the engine
        recomputes, and Redis comes back empty), and a sampler that died (meanwhile the engines fail the
        requests of each step they cannot sample, then find it again). Returns what was restarted."""
        revived = []
        if self.redis is not None and not self.redis.alive():
            self.redis.start()
            revived.append("redis-server")
        for name in ("kvstore", "sampler"):
            if name in self.services and not self.services[name].alive():
                self.restart(name)
                revived.append(name)
        return revived

    @property
    def address(self) -> str:
        return self.services["gateway"].address

    def stop(self, timeout: float = 30.0) -> None:
        """The gateway first (it drains), then the services behind it, then the kvstore and sampler, and Redis last."""
        last = ("kvstore", "sampler")
        tiers = [["gateway"], [name for name in self.services if name not in ("gateway", *last)], list(last)]
        for tier in tiers:
            processes = [self.services[name] for name in tier if name in self.services]
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout)
        if self.redis is not None:
            self.redis.stop()

    def __enter__(self) -> "Mesh":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(args: argparse.Namespace) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    gateway_args = gateway_flags(args)
    mesh = Mesh(engine_args, gateway_args, port=args.port, echo=True, **kv_store_options(args),
                **sampler_options(args), env=telemetry_env(args))
    stop = threading.Event()

    def on_signal(*_):
        stop.set()
        if not mesh.services.get("gateway") or not mesh.services["gateway"].listening.is_set():
            raise KeyboardInterrupt  # still starting: Mesh.start stops what it started

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    started = time.perf_counter()
    store = (", Redis, the kvstore" if mesh.kv_store else "") + (", the sampler" if mesh.sampler else "")
    print(f"llmmesh serve: starting the engine, tokenizer, detokenizer{store} and gateway for {engine_args.model}",
          flush=True)
    try:
        try:
            address = mesh.start()
        except KeyboardInterrupt:
            return
        print(f"llmmesh serve: every service is healthy after {time.perf_counter() - started:.1f} s", flush=True)
        print(f"llmmesh gateway listening on {address}", flush=True)
        print(f'  try: llmmesh generate "The capital of France is" --address {address}', flush=True)
        while not stop.wait(0.5):
            for name in mesh.revive_store():
                print(f"llmmesh serve: the {name} exited; restarted it", file=sys.stderr, flush=True)
            dead = [name for name, s in mesh.services.items() if not s.alive()]
            if dead:
                print(f"llmmesh serve: the {', '.join(dead)} exited; stopping the mesh", file=sys.stderr, flush=True)
                mesh.stop(args.shutdown_timeout)
                sys.exit(1)
    finally:
        print("llmmesh serve: stopping", flush=True)
        mesh.stop(args.shutdown_timeout)
        print("llmmesh serve: stopped", flush=True)


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


def gateway_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's own flags as `llmmesh serve` was given them."""
    flags = ["--host", args.host, "--shutdown-timeout", str(args.shutdown_timeout),
             "--max-requests-in-flight", str(args.max_requests_in_flight)]
    if args.served_model_name:
        flags += ["--served-model-name", args.served_model_name]
    if args.api_key:
        flags += ["--api-key", args.api_key]
    if args.trust_request_chat_template:
        flags.append("--trust-request-chat-template")
    return flags


# Whether serve and demo (make run, make serve) run the KV store unless told --no-kv-store. Mesh itself
# (tests, benchmarks) runs it only when asked: Mesh(..., kv_store=True).
KV_STORE_DEFAULT = True


def add_kv_store_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV store")
    group.add_argument("--kv-store", action=argparse.BooleanOptionalAction, default=KV_STORE_DEFAULT,
                       help="run a redis-server and the kvstore, and the engine with its KV connector to them")
    group.add_argument("--redis-maxmemory", default="2gb",
                       help="the redis-server's maxmemory (it evicts least recently used blocks beyond it)")


def kv_store_options(args: argparse.Namespace) -> dict:
    """Mesh's KV-store arguments as serve or demo was given them."""
    return {"kv_store": args.kv_store, "redis_maxmemory": args.redis_maxmemory}


def add_sampler_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sampler-service", action=argparse.BooleanOptionalAction, default=True,
                        help="run the sampler as its own service, the engine sampling on it (--no-sampler-service: "
                             "the engine samples in process)")


def sampler_options(args: argparse.Namespace) -> dict:
    return {"sampler": args.sampler_service}


def add_subcommands(subparsers) -> None:
    p = config.service_parser(
        subparsers, "serve", "run the whole mesh on loopback (one process per service)", port_of="gateway"
    )
    add_gateway_args(p)
    EngineArgs.add_cli_args(p)
    add_kv_store_args(p)
    add_sampler_args(p)
    p.set_defaults(func=serve)

    p = subparsers.add_parser("demo", help="start the mesh, stream a few generations through it, stop it")
    p.add_argument("--max-tokens", type=int, default=48)
    EngineArgs.add_cli_args(p)
    add_kv_store_args(p)
    add_sampler_args(p)
    p.set_defaults(func=run_demo)
