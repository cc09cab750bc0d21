"""The mesh on one machine, and a client for it.

`llmmesh serve` starts the engine, tokenizer, detokenizer and gateway as separate processes on loopback
(each on a free port, read from its "listening on" line), waits until the gateway reports every service
healthy, prints the gateway's address and stops everything on Ctrl-C or SIGTERM. `llmmesh generate` and
`llmmesh chat` stream text from a running gateway to the terminal. `generate()`, `chat()` and `collect()`
are the client for tests and benchmarks.
"""

import argparse
import dataclasses
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from engine.config import EngineArgs
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway import add_gateway_args

LISTENING = re.compile(r"llmmesh (\w+) listening on (\S+)")
DEFAULT_ADDRESS = "127.0.0.1:8000"


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
            [sys.executable, "-m", "engine.cli", service, *args],
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
            model = ["--model", self.engine_args.model]
            self._start("gateway", ["--port", str(self.port), *model, *self.gateway_args, *self.backend_flags()])
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
        model = ["--model", self.engine_args.model]
        process = ServiceProcess("gateway", ["--port", "0", *model, *args, *self.backend_flags()], self.echo)
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
    gateway_args = ["--max-waiting-requests", str(args.max_waiting_requests),
                    "--shutdown-timeout", str(args.shutdown_timeout)]
    if args.api_key:
        gateway_args += ["--api-key", args.api_key]
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


# ---- the client ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def gateway_stub(address: str) -> gateway_pb2_grpc.GatewayStub:
    """A stub on one shared channel per address."""
    return gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(address))


def sampling_params(**kwargs) -> common_pb2.SamplingParams:
    """SamplingParams from keyword arguments (vLLM's names); None leaves a field at its default."""
    return common_pb2.SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})


def _metadata(api_key: str | None):
    return [("authorization", f"Bearer {api_key}")] if api_key else None


def generate(address: str, prompt: str | list[int], *, stream: bool = True, api_key: str | None = None,
             timeout: float | None = None, model: str = "", request_id: str = "", priority: int = 0,
             **sampling) -> Iterator[gateway_pb2.GenerateResponse]:
    """Stream a Generate: the responses as they come (grpc.RpcError on failure; .cancel() ends it)."""
    request = gateway_pb2.GenerateRequest(
        model=model, stream=stream, request_id=request_id, priority=priority, sampling_params=sampling_params(**sampling)
    )
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return gateway_stub(address).Generate(request, timeout=timeout, metadata=_metadata(api_key))


def chat(address: str, messages: list[dict], *, stream: bool = True, api_key: str | None = None,
         timeout: float | None = None, model: str = "", **sampling) -> Iterator[gateway_pb2.GenerateResponse]:
    """Stream a Chat; messages are {"role", "content"} dicts."""
    request = gateway_pb2.ChatRequest(
        model=model, stream=stream, sampling_params=sampling_params(**sampling),
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
    )
    return gateway_stub(address).Chat(request, timeout=timeout, metadata=_metadata(api_key))


@dataclass
class GenerateResult:
    """A whole response: the text deltas per choice as they came, and the final message."""

    deltas: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)
    complete: gateway_pb2.Complete | None = None

    def text(self, index: int = 0) -> str:
        if self.deltas:
            return "".join(self.deltas.get(index, []))
        return next(c.text for c in self.complete.choices if c.index == index)  # stream=False

    def choice(self, index: int = 0) -> gateway_pb2.Choice:
        return next(c for c in self.complete.choices if c.index == index)


def collect(responses) -> GenerateResult:
    result = GenerateResult()
    for response in responses:
        if response.HasField("chunk"):
            for delta in response.chunk.choices:
                result.deltas.setdefault(delta.index, []).append(delta.text)
                result.token_ids.setdefault(delta.index, []).extend(delta.token_ids)
        else:
            result.complete = response.complete
    return result


# ---- the client commands -------------------------------------------------------------------------


def _print_stream(responses) -> None:
    started = time.perf_counter()
    first = None
    try:
        for response in responses:
            if response.HasField("chunk"):
                for delta in response.chunk.choices:
                    if delta.index == 0 and delta.text:
                        first = first or time.perf_counter()
                        print(delta.text, end="", flush=True)
            else:
                print(flush=True)
                choice = response.complete.choices[0]
                stop = choice.WhichOneof("stop_reason")
                usage = response.complete.usage
                elapsed = time.perf_counter() - started
                print(
                    f"[finish_reason={choice.finish_reason}"
                    + (f", stop_reason={getattr(choice, stop)!r}" if stop else "")
                    + f", {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens"
                    + (f", first text after {first - started:.2f} s" if first else "")
                    + f", {elapsed:.2f} s in all]",
                    file=sys.stderr,
                )
    except grpc.RpcError as e:
        print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
        sys.exit(1)


def _sampling_args(args) -> dict:
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                seed=args.seed, stop=args.stop or None)


def run_generate(args: argparse.Namespace) -> None:
    _print_stream(generate(args.address, args.prompt, api_key=args.api_key, timeout=args.timeout,
                           model=args.model, **_sampling_args(args)))


def run_chat(args: argparse.Namespace) -> None:
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.message}
    ]
    _print_stream(chat(args.address, messages, api_key=args.api_key, timeout=args.timeout,
                       model=args.model, **_sampling_args(args)))


DEMO_PROMPTS = ["The capital of France is", "def quicksort(items):", "Three facts about the Moon:"]
DEMO_CHAT = [{"role": "user", "content": "Write a haiku about paged memory."}]


def run_demo(args: argparse.Namespace) -> None:
    """Start the mesh, stream a few greedy generations and a chat through the gateway, stop it."""
    started = time.perf_counter()
    with Mesh(EngineArgs.from_cli_args(args)) as mesh:
        print(f"mesh up in {time.perf_counter() - started:.1f} s, gateway at {mesh.address}", flush=True)
        for prompt in DEMO_PROMPTS:
            print(f"\n>>> {prompt}", flush=True)
            _print_stream(generate(mesh.address, prompt, max_tokens=args.max_tokens, temperature=0.0))
        print(f"\n>>> chat: {DEMO_CHAT[0]['content']}", flush=True)
        _print_stream(chat(mesh.address, DEMO_CHAT, max_tokens=args.max_tokens, temperature=0.0))
    print("\nmesh stopped", flush=True)


def _add_client_args(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument("--address", default=env("LLMMESH_ADDRESS", DEFAULT_ADDRESS), help="the gateway's HOST:PORT")
    parser.add_argument("--api-key", default=env("LLMMESH_API_KEY"))
    parser.add_argument("--model", default=env("LLMMESH_MODEL", ""), help="empty: the served model")
    parser.add_argument("--max-tokens", type=int, default=int(env("LLMMESH_MAX_TOKENS", 128)))
    parser.add_argument("--temperature", type=float, default=None, help="default 1.0; 0: greedy")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", help="a stop string (repeatable)")
    parser.add_argument("--timeout", type=float, default=None, help="deadline in seconds")


def add_subcommands(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the whole mesh on loopback (one process per service)")
    p.add_argument("--port", type=int, default=int(os.environ.get("LLMMESH_PORT", 8000)), help="the gateway's port")
    add_gateway_args(p)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=serve)

    p = subparsers.add_parser("demo", help="start the mesh, stream a few generations through it, stop it")
    p.add_argument("--max-tokens", type=int, default=48)
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_demo)

    p = subparsers.add_parser("generate", help="stream a completion from a running gateway")
    p.add_argument("prompt")
    _add_client_args(p)
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("chat", help="stream a chat reply from a running gateway")
    p.add_argument("message")
    p.add_argument("--system", default=None, help="a system message to put first")
    _add_client_args(p)
    p.set_defaults(func=run_chat)
