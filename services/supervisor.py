"""The mesh on one machine: services as child processes, started, watched and stopped in order.

`llmmesh serve` starts the engine, tokenizer, detokenizer and gateway as separate processes on loopback
(each on a free port, read from its "listening on" line), waits until the gateway reports every service
healthy, prints the gateway's address and stops everything on Ctrl-C or SIGTERM. `llmmesh demo` does the
same, streams a few generations through it and stops. Tests and benchmarks start services the same way.
"""

import argparse
import dataclasses
import re
import signal
import subprocess
import sys
import threading
import time

from engine.config import EngineArgs
from services import client, config
from services.gateway import add_gateway_args

LISTENING = re.compile(r"llmmesh (\w+) listening on (\S+)")


# ---- running services as processes --------------------------------------------------------------


class ServiceProcess:
    """`llmmesh <service> <args>` as a child process; its address comes from its listening line."""

    def __init__(self, service: str, args: list[str], echo: bool = False):
        self.service = service
        self.address: str | None = None
        self.listening = threading.Event()
        self.echo = echo
        # Its own session: a Ctrl-C at the terminal reaches `serve`, which stops the services in order.
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", service, *args],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )
        threading.Thread(target=self._read_stdout, name=f"{service}-stdout", daemon=True).start()

    def _read_stdout(self) -> None:
        for line in self.popen.stdout:
            match = LISTENING.search(line)
            if match and match.group(1) == self.service and self.address is None:
                self.address = match.group(2)
                self.listening.set()
            elif self.echo:
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


class Mesh:
    """Engine, tokenizer, detokenizer and gateway processes on loopback."""

    def __init__(self, engine_args: EngineArgs, gateway_args: list[str] = (), port: int = 0, echo: bool = False):
        self.engine_args = engine_args
        self.gateway_args = list(gateway_args)
        self.port = port
        self.echo = echo
        self.services: dict[str, ServiceProcess] = {}

    def start(self, timeout: float = 600.0) -> str:
        """Start everything and wait until the gateway is serving; returns the gateway's address."""
        self.launch()
        return self.wait(timeout)

    def launch(self) -> None:
        """Start the engine, tokenizer and detokenizer (they load at the same time); wait() finishes the job."""
        model = ["--model", self.engine_args.model]
        self._start("engine", ["--port", "0", *engine_flags(self.engine_args)])
        self._start("tokenizer", ["--port", "0", *model])
        self._start("detokenizer", ["--port", "0", *model])

    def wait(self, timeout: float = 600.0) -> str:
        """Wait for the services, then start the gateway in front of them and wait until it is serving."""
        try:
            for name in ("engine", "tokenizer", "detokenizer"):
                self.services[name].wait_listening(timeout)
            self._start("gateway", ["--port", str(self.port), *self.gateway_args, *self.backend_flags()])
            return self.services["gateway"].wait_listening(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, args: list[str]) -> ServiceProcess:
        self.services[name] = ServiceProcess(name, args, self.echo)
        return self.services[name]

    def backend_flags(self) -> list[str]:
        """The gateway flags that point at this mesh's engine, tokenizer and detokenizer."""
        return [flag for name in ("engine", "tokenizer", "detokenizer")
                for flag in (f"--{name}", self.services[name].address)]

    def start_gateway(self, args: list[str], timeout: float = 60.0) -> ServiceProcess:
        """Another gateway (on a free port) in front of the same services, e.g. with other flags."""
        process = ServiceProcess("gateway", ["--port", "0", *args, *self.backend_flags()], self.echo)
        process.wait_listening(timeout)
        return process

    def restart(self, name: str, timeout: float = 120.0) -> ServiceProcess:
        """Start a text service again on the port it had (after it died or was killed)."""
        old = self.services[name]
        if old.alive():
            old.kill()
        self._start(name, ["--port", str(old.port), "--model", self.engine_args.model])
        self.services[name].wait_listening(timeout)
        return self.services[name]

    @property
    def address(self) -> str:
        return self.services["gateway"].address

    def stop(self, timeout: float = 30.0) -> None:
        """The gateway first (it drains), then the services behind it."""
        if "gateway" in self.services:
            self.services["gateway"].stop(timeout)
        backends = [s for name, s in self.services.items() if name != "gateway"]
        for service in backends:
            service.terminate()
        for service in backends:
            service.wait(timeout)

    def __enter__(self) -> "Mesh":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(args: argparse.Namespace) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    gateway_args = gateway_flags(args)
    mesh = Mesh(engine_args, gateway_args, port=args.port, echo=True)
    stop = threading.Event()

    def on_signal(*_):
        stop.set()
        if not mesh.services.get("gateway") or not mesh.services["gateway"].listening.is_set():
            raise KeyboardInterrupt  # still starting: Mesh.start stops what it started

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    started = time.perf_counter()
    print(f"llmmesh serve: starting the engine, tokenizer, detokenizer and gateway for {engine_args.model}", flush=True)
    try:
        try:
            address = mesh.start()
        except KeyboardInterrupt:
            return
        print(f"llmmesh serve: every service is healthy after {time.perf_counter() - started:.1f} s", flush=True)
        print(f"llmmesh gateway listening on {address}", flush=True)
        print(f'  try: llmmesh generate "The capital of France is" --address {address}', flush=True)
        while not stop.wait(0.5):
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
    with Mesh(EngineArgs.from_cli_args(args)) as mesh:
        print(f"mesh up in {time.perf_counter() - started:.1f} s, gateway at {mesh.address}", flush=True)
        for prompt in DEMO_PROMPTS:
            print(f"\n>>> {prompt}", flush=True)
            client.print_stream(client.generate(mesh.address, prompt, max_tokens=args.max_tokens, temperature=0.0))
        print(f"\n>>> chat: {DEMO_CHAT[0]['content']}", flush=True)
        client.print_stream(client.chat(mesh.address, DEMO_CHAT, max_tokens=args.max_tokens, temperature=0.0))
    print("\nmesh stopped", flush=True)


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


def add_subcommands(subparsers) -> None:
    p = config.service_parser(
        subparsers, "serve", "run the whole mesh on loopback (one process per service)", port_of="gateway"
    )
    add_gateway_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=serve)

    p = subparsers.add_parser("demo", help="start the mesh, stream a few generations through it, stop it")
    p.add_argument("--max-tokens", type=int, default=48)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_demo)
