"""The mesh on one machine: services as child processes, started, watched and stopped in order.

`llmmesh serve` starts the engine, tokenizer, detokenizer and gateway as separate processes on loopback
(each on a free port, read from its "listening on" line), waits until the gateway reports every service
healthy, prints the gateway's address and stops everything on Ctrl-C or SIGTERM. A service that dies is
started again on its port (supervise); one that keeps dying stops the mesh. `llmmesh demo` does the same,
streams a few generations through it and stops. Tests and benchmarks start services the same way.
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
from engine.config.utils import add_cli_args
from engine.limits import RequestLimits
from services import client, config, kvstore_service
from services.gateway import add_gateway_args
from services.prometheus import scrape_config
from services.settings import MAX_ENGINES, DemoConfig, MeshConfig, ServeFlags

LISTENING = re.compile(r"llmmesh (\w+) listening on (\S+)")
METRICS = re.compile(r"llmmesh (\w+) metrics on (\S+)")  # with --metrics-port (services.telemetry)

# `llmmesh serve` starts a service that died again after RESTART_BACKOFF_S, doubled for each time it was restarted
# in the last RESTART_WINDOW_S. A service that dies once more after MAX_RESTARTS restarts in that window is in a
# crash loop: serve stops the mesh and says so. The window is long enough to hold five deaths of an engine that
# fails each time after loading for a minute.
RESTART_BACKOFF_S = 0.25
MAX_RESTARTS = 5
RESTART_WINDOW_S = 300.0
REDIS = "redis-server"  # Redis's name among the mesh's processes


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
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
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


def exit_status(returncode: int) -> str:
    """A process's exit as words: "exit code 1", "killed by SIGKILL"."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def set_flag(args: list[str], flag: str, value) -> list[str]:
    """args with flag set to value: in place of its last occurrence (the one argparse keeps), else appended."""
    if flag not in args:
        return [*args, flag, str(value)]
    i = len(args) - 1 - args[::-1].index(flag)
    return [*args[: i + 1], str(value), *args[i + 2 :]]


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
            raise RuntimeError(
                "redis-server is not installed: `make setup` installs Debian's redis-server when run as "
                "root (or: apt-get install redis-server), or run without the KV store (--no-kv-store)"
            )
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
        raise RuntimeError(
            f"redis-server did not start on 127.0.0.1:{self.port or 'a free port'} (exit code "
            f"{self.popen.returncode}); run it with echo=True to see its log"
        )

    def _launch(self, port: int, timeout: float) -> bool:
        ready = threading.Event()
        self.popen = subprocess.Popen(
            [
                self.executable,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--protected-mode",
                "yes",
                "--dir",
                self.dir,
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--logfile",
                "",
                "--maxmemory",
                self.maxmemory,
                "--maxmemory-policy",
                "allkeys-lru",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
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
        elif isinstance(value, list) and all(isinstance(v, str) for v in value):  # --lora-modules a=/x b=/y
            flags += [flag, *value]
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def kv_transfer_config(kvstore_address: str, kv_role: str = "kv_both", **options) -> str:
    """The engine's --kv-transfer-config (vLLM's form) for a connector to the kvstore at kvstore_address, in
    kv_role, with any further connector options (load_policy, store_decode_blocks, timeouts)."""
    return json.dumps(
        {
            "kv_connector": "KVStoreConnector",
            "kv_role": kv_role,
            "kv_connector_extra_config": {"kvstore_address": kvstore_address, **options},
        },
        separators=(",", ":"),
    )


class Mesh:
    """Engine, tokenizer, detokenizer and gateway processes on loopback; with kv_store, also a redis-server
    and the kvstore, started before the engine, which is given a --kv-transfer-config pointing at the kvstore.

    service_args: further flags for the services behind the gateway, by service ("engine": every replica,
    "tokenizer", "detokenizer", "kvstore", "sampler"); the gateway's own are gateway_args.

    kv_connector_options: further kv_connector_extra_config for every engine's connector to the kvstore (load_policy,
    store_decode_blocks, timeouts: mesh/kvstore/connector.py).

    prefill_engines > 0 disaggregates prefill (vLLM's P/D through the KV store, which it then needs): that many
    kv_producer engines ("prefill", "prefill-2"...) compute the prompts, and the num_engines others, kv_consumers,
    load their blocks from the kvstore and decode."""

    def __init__(
        self,
        engine_args: EngineArgs,
        gateway_args: list[str] = (),
        port: int = 0,
        echo: bool = False,
        kv_store: bool = False,
        redis_maxmemory: str = "2gb",
        num_engines: int = 1,
        sampler: bool = False,
        env: dict | None = None,
        service_args: dict[str, list[str]] | None = None,
        prefill_engines: int = 0,
        kv_connector_options: dict | None = None,
    ):
        self.engine_args = engine_args
        self.env = env  # variables every service gets on top of this process's (LLMMESH_*, OTEL_*)
        self.gateway_args = list(gateway_args)
        self.service_args = dict(service_args or {})
        self.port = port
        self.echo = echo
        self.kv_store = kv_store
        self.redis_maxmemory = redis_maxmemory
        self.kv_connector_options = dict(kv_connector_options or {})
        self.redis: RedisServer | None = None
        self.sampler = sampler  # a sampler service (started before the engines, which sample on it)
        # "engine", then "engine-2"...: replicas behind the one gateway (sharing the KV store, when there is one)
        self.engine_names = ["engine"] + [f"engine-{i}" for i in range(2, num_engines + 1)]
        self.prefill_names = [f"prefill{'' if i == 1 else f'-{i}'}" for i in range(1, prefill_engines + 1)]
        if prefill_engines and not kv_store:
            raise ValueError("prefill engines hand their KV blocks over through the KV store: it must run.")
        if num_engines > 1:  # the gateway routes by where their KV blocks are
            self.engine_args = dataclasses.replace(engine_args, enable_kv_cache_events=True)
        self.services: dict[str, ServiceProcess] = {}

    def start(self, timeout: float = 600.0) -> str:
        """Start everything and wait until the gateway is serving; returns the gateway's address."""
        self.launch()
        return self.wait(timeout)

    def launch(self, timeout: float = 60.0) -> None:
        """Start the engine, tokenizer and detokenizer (they load at the same time), after Redis and the kvstore
        when the KV store is on; wait() finishes the job."""
        engine_args, flags = self.engine_args, self.service_args
        prefill_args = engine_args
        try:
            if self.kv_store:
                self.redis = RedisServer(maxmemory=self.redis_maxmemory, echo=self.echo)
                kvstore = self._start(
                    "kvstore", ["--port", "0", "--redis-url", self.redis.url, *flags.get("kvstore", [])]
                )
                kvstore_address = kvstore.wait_listening(timeout)
                if self.prefill_names:
                    # Its requests' do_remote_prefill makes a consumer load what the producers stored, whatever its
                    # load_policy; the policy still judges what other engines stored.
                    consumer = kv_transfer_config(kvstore_address, "kv_consumer", **self.kv_connector_options)
                    producer = kv_transfer_config(kvstore_address, "kv_producer", **self.kv_connector_options)
                    prefill_args = dataclasses.replace(engine_args, kv_transfer_config=producer)
                    engine_args = dataclasses.replace(engine_args, kv_transfer_config=consumer)
                else:
                    config = kv_transfer_config(kvstore_address, **self.kv_connector_options)
                    engine_args = dataclasses.replace(engine_args, kv_transfer_config=config)
            if self.sampler:
                sampler = self._start("sampler", ["--port", "0", *flags.get("sampler", [])])
                engine_args = dataclasses.replace(engine_args, sampler_address=sampler.wait_listening(timeout))
                prefill_args = dataclasses.replace(prefill_args, sampler_address=engine_args.sampler_address)
        except BaseException:
            self.stop()
            raise
        model = ["--model", engine_args.model]
        for names, args in ((self.engine_names, engine_args), (self.prefill_names, prefill_args)):
            for name in names:
                self._start(name, ["--port", "0", *engine_flags(args), *flags.get("engine", [])], service="engine")
        self._start("tokenizer", ["--port", "0", *model, *flags.get("tokenizer", [])])
        self._start("detokenizer", ["--port", "0", *model, *flags.get("detokenizer", [])])

    def wait(self, timeout: float = 600.0) -> str:
        """Wait for the services, then start the gateway in front of them and wait until it is serving."""
        try:
            for name in (*self.engine_names, *self.prefill_names, "tokenizer", "detokenizer"):
                self.services[name].wait_listening(timeout)
            self._start("gateway", ["--port", str(self.port), *self.gateway_args, *self.backend_flags()])
            return self.services["gateway"].wait_listening(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str], service: str | None = None) -> ServiceProcess:
        service = service or name
        env = self.env
        if service == "engine":
            env = {**self.engine_threads(), **(self.env or {})}
        self.services[name] = ServiceProcess(service, args, self.echo, env or None)
        return self.services[name]

    def engine_threads(self) -> dict:
        """Engines on one machine split its cores: each gets cores // engines threads (OMP_NUM_THREADS), unless
        OMP_NUM_THREADS is set. Two engines of two threads each on two cores wait on each other at every OpenMP
        barrier: their decode steps took 15x as long as one engine's alone (0.82 against 0.053 s)."""
        num_engines = len(self.engine_names) + len(self.prefill_names)
        if num_engines == 1 or "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in (self.env or {}):
            return {}
        return {"OMP_NUM_THREADS": str(max(1, len(os.sched_getaffinity(0)) // num_engines))}

    def backend_flags(self) -> list[str]:
        """The gateway flags that point at this mesh's engines, tokenizer and detokenizer."""
        flags = [
            flag
            for name in (*self.engine_names, "tokenizer", "detokenizer")
            for flag in (f"--{self.services[name].service}", self.services[name].address)
        ]
        return flags + [
            flag for name in self.prefill_names for flag in ("--prefill-engine", self.services[name].address)
        ]

    def start_gateway(self, args: list[str], timeout: float = 60.0) -> ServiceProcess:
        """Another gateway (on a free port) in front of the same services, e.g. with other flags."""
        process = ServiceProcess("gateway", ["--port", "0", *args, *self.backend_flags()], self.echo, self.env)
        process.wait_listening(timeout)
        return process

    def restart(self, name: str, timeout: float = 120.0) -> ServiceProcess:
        """Start a service again with its flags, on the port it had (after it died or was killed), and wait
        until it is serving."""
        self.relaunch(name)
        self.services[name].wait_listening(timeout)
        return self.services[name]

    def relaunch(self, name: str) -> None:
        """Start a service (or REDIS) again with its flags, on the ports it had, its /metrics too; kill it first if
        it still runs. The others find it there again: the gateway and engines reconnect on their own. Redis comes
        back empty (the store is a cache), and blocks until it is ready; a service is serving once .listening."""
        if name == REDIS:
            self.redis.start()
            return
        old = self.services[name]
        if old.alive():
            old.kill()
        args = old.args
        if old.address is not None:  # else it died before it served, and its args hold the ports to use
            args = set_flag(args, "--port", old.port)
        if old.metrics_address is not None:
            args = set_flag(args, "--metrics-port", old.metrics_address.rsplit(":", 1)[1])
        self._start(name, args, service=old.service)

    def dead(self) -> list[str]:
        """The services (and REDIS) whose process has exited."""
        dead = [REDIS] if self.redis is not None and not self.redis.alive() else []
        return dead + [name for name, process in self.services.items() if not process.alive()]

    def popen(self, name: str) -> subprocess.Popen:
        """The process of a service, or of REDIS."""
        return (self.redis if name == REDIS else self.services[name]).popen

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
    if args.prometheus_config and args.metrics_port is None:
        raise ValueError("--prometheus-config needs --metrics-port (0: each service on a free port of its own)")
    if not 1 <= args.engines <= MAX_ENGINES:
        raise ValueError(f"--engines must be from 1 to {MAX_ENGINES}, got {args.engines}.")
    num_engines = disaggregated_engines(args)
    engine_args = EngineArgs.from_cli_args(args)
    flags = service_flags(args)
    mesh = Mesh(
        engine_args,
        flags.pop("gateway"),
        port=args.port,
        echo=True,
        num_engines=num_engines,
        prefill_engines=args.prefill_engines,
        **kv_store_options(args),
        **sampler_options(args),
        env=telemetry_env(args),
        service_args=flags,
    )
    stop, started = threading.Event(), threading.Event()

    def on_signal(*_):
        stop.set()
        if not started.is_set():
            raise KeyboardInterrupt  # still starting: Mesh.start stops what it started

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
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
        print(f'  try: llmmesh generate "The capital of France is" --address {address}', flush=True)
        crash_loop = supervise(mesh, stop)
        if crash_loop:
            say(crash_loop, error=True)
            sys.exit(1)
    finally:
        say("stopping")
        mesh.stop(args.shutdown_timeout)
        say("stopped")


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


def supervise(mesh: Mesh, stop: threading.Event, poll_s: float = 0.1) -> str | None:
    """Start every process of the mesh that dies again, on its ports, after restart_backoff, until stop is set.
    Returns why it gave up instead: a process in a crash loop."""
    restarts: dict[str, list[float]] = {}  # name -> when it was started again, in the last RESTART_WINDOW_S
    due: dict[str, float] = {}  # a dead process -> when to start it again
    starting: set[str] = set()  # started again, not serving yet
    while not stop.wait(poll_s):
        now = time.monotonic()
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


def as_flags(args: argparse.Namespace, dests) -> list[str]:
    """`--name value` for each dest, as args holds it."""
    return [flag for dest in dests for flag in ("--" + dest.replace("_", "-"), str(getattr(args, dest)))]


def service_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """`llmmesh serve`'s flags for each service that takes them, by service. The engine's own (EngineArgs) go to it
    as Mesh's engine_args, --model also to the text services, and tracing and metrics as telemetry_env; the
    gateway alone binds --host and --port, the others listen on loopback."""
    every = ["--log-level", args.log_level]
    drain = ["--shutdown-timeout", str(args.shutdown_timeout)]
    limits = as_flags(args, [f.name for f in dataclasses.fields(RequestLimits)])
    store = as_flags(args, ("redis_timeout", "max_blocks_per_request", "max_block_bytes"))
    trust = ["--trust-request-chat-template"] if args.trust_request_chat_template else []
    gateway = ["--host", args.host, "--max-requests-in-flight", str(args.max_requests_in_flight)]
    gateway += ["--prefill-timeout", str(args.prefill_timeout)]
    if args.served_model_name:
        gateway += ["--served-model-name", args.served_model_name]
    if args.api_key:
        gateway += ["--api-key", args.api_key]
    if args.routing:
        gateway += ["--routing", args.routing]
    engine = ["--collect-detailed-traces", args.collect_detailed_traces] if args.collect_detailed_traces else []
    # The sampler samples where the engine runs (its seeded draws follow that device's generator) when the engine's
    # device is named; with "auto" it stays on the CPU, its default.
    device = ["--device", args.device] if args.device != "auto" else []
    return {
        "gateway": [*every, *drain, *gateway, *trust, *limits],
        "engine": [*every, *drain, *engine, *limits],
        "tokenizer": [*every, *drain, *trust, *limits],
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
        subparsers, "serve", "run the whole mesh on loopback (one process per service)", port_of="gateway"
    )
    p.description = (
        "Run the whole mesh on loopback, one process per service; each flag reaches every service that takes it. "
        f"A service that dies is started again on its port after {RESTART_BACKOFF_S:g} s, doubled for each restart "
        f"of it in the last {RESTART_WINDOW_S:g} s; one that dies after {MAX_RESTARTS} restarts within "
        f"{RESTART_WINDOW_S:g} s is in a crash loop, and serve stops the mesh and exits with code 1."
    )
    add_gateway_args(p)
    add_cli_args(p, ServeFlags, grouped=False)
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
