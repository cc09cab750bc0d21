"""`llmmesh serve` as a user runs it, one process that starts and watches the mesh: each of its flags reaches
every service that takes it (the request limits in force at the gateway, the engine and the text services),
it writes a Prometheus scrape configuration for the mesh, a service that dies (the engine included) is started
again on its port, and one that keeps dying stops the mesh with a message that says so."""

import argparse
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from conftest import NOT_SERVING, SERVING, mesh_channel, wait_for_health
from engine.config import EngineArgs
from engine.limits import RequestLimits
from llmmesh.v1 import (
    common_pb2,
    detokenizer_pb2,
    detokenizer_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    gateway_pb2,
    tokenizer_pb2,
    tokenizer_pb2_grpc,
)
from mesh import tls
from services import supervisor
from services.cli import build_parser
from services.client import collect, gateway_stub, generate

# Small limits, so that each is easy to pass; every RequestLimits field has one.
LIMITS = dict(
    max_n=2,
    max_stop=2,
    max_stop_chars=8,
    max_stop_token_ids=2,
    max_bad_words=2,
    max_bad_word_chars=8,
    max_logit_bias=2,
    max_allowed_token_ids=4,
    max_structured_output_chars=8,
    max_messages=2,
    max_prompt_chars=64,
    max_id_chars=40,
    max_batch=4,
    max_open_requests=4,
)
PROMPT = "The capital of France is"
GREEDY = dict(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = dict(temperature=0.0, max_tokens=1000, ignore_eos=True)  # runs far longer than the test needs
WAIT_S = 120.0  # a bound on waiting for serve's lines (a service loads in seconds); no speed is asserted


def over(limit: str) -> int:
    """One past a limit."""
    return LIMITS[limit] + 1


# ---- which service each flag of serve reaches (no process) ---------------------------------------------


def subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def other_value(action: argparse.Action):
    """A value for the flag other than its default."""
    if action.nargs == 0:
        return not action.default
    if action.choices:
        return next(c for c in action.choices if c != action.default)
    if action.type is int:
        return 2 * (action.default or 1)
    if action.type is float:
        return (action.default or 1.0) / 2
    return "x"


def as_argv(action: argparse.Action, value) -> list[str]:
    if action.nargs == 0:  # --flag, or --no-flag for a BooleanOptionalAction's false
        return [action.option_strings[0] if value else action.option_strings[-1]]
    return [action.option_strings[0], str(value)]


def test_every_flag_of_serve_reaches_each_service_that_takes_it(monkeypatch):
    """Each service parses what serve hands it (flags, and the environment telemetry_env sets) to the value
    serve was given, for every flag serve and that service share. The engine's own flags go to it as EngineArgs
    (engine_flags, tested for a round trip elsewhere)."""
    serve_parser = subcommand(build_parser(), "serve")
    engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
    chosen = {a.dest: (a, other_value(a)) for a in options(serve_parser) if a.dest not in engine_fields}
    args = build_parser().parse_args(["serve", *[arg for a, v in chosen.values() for arg in as_argv(a, v)]])
    assert all(getattr(args, dest) == value for dest, (_, value) in chosen.items())

    for name, value in supervisor.telemetry_env(args).items():
        monkeypatch.setenv(name, value)
    # A key never goes on a command line: the gateway inherits serve's environment, where it is.
    monkeypatch.setenv("LLMMESH_API_KEY", chosen["api_key"][1])

    def passed_on(service: str, dest: str) -> bool:
        if dest == "host":  # the services behind the gateway listen on loopback
            return service == "gateway"
        if dest == "shutdown_timeout":  # the sampler's drain stays short: an engine's stream lasts as long as it
            return service != "sampler"
        return dest not in ("port", "metrics_port")  # Mesh gives each its ports, /metrics on a free one

    reached = set()
    for service, flags in supervisor.service_flags(args).items():
        parsed = build_parser().parse_args([service, *flags])
        for dest, (_, value) in chosen.items():
            if hasattr(parsed, dest) and passed_on(service, dest):
                assert getattr(parsed, dest) == value, f"{service} --{dest}: {getattr(parsed, dest)!r}, serve {value!r}"
                reached.add(dest)
    assert reached >= {"host", "log_level", "collect_detailed_traces", "trust_request_chat_template", *LIMITS}
    assert reached >= {"redis_timeout", "max_blocks_per_request", "max_block_bytes"}  # the kvstore's own
    # What is left is serve's own: how it runs the mesh.
    assert set(chosen) - reached == {
        "port",
        "metrics_port",
        "kv_store",
        "redis_maxmemory",
        "sampler_service",
        "prometheus_config",
        "engines",
        "prefill_engines",
        "decode_engines",
    }
    assert reached >= {"allowed_local_media_path"}  # the tokenizer's and the engine's image files
    # The engine's image limits (EngineArgs) hold in the tokenizer too, which decodes the images first.
    images = ["--limit-mm-per-prompt", "3", "--max-image-pixels", "1000"]
    tokenizer_flags = supervisor.service_flags(build_parser().parse_args(["serve", *images]))["tokenizer"]
    tokenizer = build_parser().parse_args(["tokenizer", *tokenizer_flags])
    assert (tokenizer.limit_mm_per_prompt, tokenizer.max_image_pixels) == (3, 1000)
    # The engine's flags reach it as EngineArgs; a device named for it is the sampler's too.
    sampler = supervisor.service_flags(build_parser().parse_args(["serve", "--device", "cpu"]))["sampler"]
    assert build_parser().parse_args(["sampler", *sampler]).device == "cpu"


def test_restart_backoff_doubles_and_a_crash_loop_ends_it():
    now = 1000.0
    assert supervisor.restart_backoff([], now) == supervisor.RESTART_BACKOFF_S
    restarts = []
    for i in range(supervisor.MAX_RESTARTS):
        assert supervisor.restart_backoff(restarts, now) == supervisor.RESTART_BACKOFF_S * 2**i
        restarts.append(now)
        now += 1.0
    assert supervisor.restart_backoff(restarts, now) is None  # one death too many within the window
    # Once the first restart is older than the window, it no longer counts.
    assert supervisor.restart_backoff(restarts, restarts[0] + supervisor.RESTART_WINDOW_S) is not None


# ---- llmmesh serve as a process -------------------------------------------------------------------------


# `the engine is serving: HOST:PORT (pid N, /metrics at HOST:PORT)`, and `is serving again` after a restart.
SERVING_LINE = r"llmmesh serve: the (\S+) is serving(?: again)?: (\S+) \(pid (\d+)(?:, /metrics at (\S+))?\)"


class Serve:
    """`llmmesh serve FLAGS` as a child process; its output (stdout and stderr) read line by line as it comes."""

    def __init__(self, flags: list[str], env: dict | None = None):
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "serve", *flags],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=None if env is None else {**os.environ, **env},
        )
        self.lines: list[str] = []
        self.cursor = 0  # expect() looks from here on
        self.services: dict[str, tuple[str, int, str]] = {}  # name -> address, pid, /metrics address
        self.address: str | None = None  # the gateway's
        self.changed = threading.Condition()
        threading.Thread(target=self._read, name="serve-output", daemon=True).start()

    def _read(self) -> None:
        with self.popen.stdout:
            for line in self.popen.stdout:
                with self.changed:
                    self.lines.append(line)
                    self.changed.notify_all()
        with self.changed:
            self.changed.notify_all()

    def expect(self, pattern: str, timeout: float = WAIT_S) -> re.Match:
        """The next line (after the last one expected) that matches pattern; fails if serve ends or timeout passes."""
        deadline = time.monotonic() + timeout
        with self.changed:
            while True:
                for i in range(self.cursor, len(self.lines)):
                    if match := re.search(pattern, self.lines[i]):
                        self.cursor = i + 1
                        return match
                self.cursor = len(self.lines)
                left = deadline - time.monotonic()
                assert left > 0 and (self.popen.poll() is None or not self.popen.stdout.closed), (
                    f"serve printed no line matching {pattern!r}; its output:\n{''.join(self.lines[-60:])}"
                )
                self.changed.wait(min(left, 1.0))

    def stop(self) -> None:
        """SIGTERM, as Ctrl-C would: serve stops the mesh in order, and is gone within a minute."""
        self.popen.terminate()
        try:
            self.popen.wait(60)
        finally:
            self.popen.kill()  # nothing once it has exited


@pytest.fixture(scope="module")
def prometheus_config(tmp_path_factory):
    return tmp_path_factory.mktemp("serve") / "prometheus.yml"


@pytest.fixture(scope="module")
def serve(prometheus_config):
    limits = [arg for name, value in LIMITS.items() for arg in ("--" + name.replace("_", "-"), str(value))]
    process = Serve(
        [
            "--port",
            "0",
            "--kv-cache-memory",
            "64MiB",
            "--no-kv-store",
            "--log-level",
            "WARNING",
            "--metrics-port",
            "0",
            "--prometheus-config",
            str(prometheus_config),
            *limits,
        ],
        env={"LLMMESH_HOST": "0.0.0.0"},  # as the Docker image sets it
    )
    try:
        while len(process.services) < 5:  # the engine, tokenizer, detokenizer, sampler and gateway
            name, address, pid, metrics = process.expect(SERVING_LINE).groups()
            process.services[name] = (address, int(pid), metrics)
        process.expect("wrote a Prometheus scrape configuration for 5 services to " + re.escape(str(prometheus_config)))
        process.address = process.expect(r"llmmesh gateway listening on (\S+)").group(1)
        process.hosts = {name: address.rsplit(":", 1)[0] for name, (address, _, _) in process.services.items()}
        # Reached on loopback from here, a name its certificate carries (0.0.0.0 is none).
        process.address = process.address.replace("0.0.0.0:", "127.0.0.1:")
        address, pid, metrics = process.services["gateway"]
        process.services["gateway"] = (address.replace("0.0.0.0:", "127.0.0.1:"), pid, metrics)
        yield process
    finally:
        process.stop()


def test_in_the_docker_images_environment_only_the_gateway_listens_beyond_loopback(serve):
    """LLMMESH_HOST=0.0.0.0 (the image's) reaches the gateway; every service behind it binds loopback all the same."""
    assert serve.hosts == {
        "gateway": "0.0.0.0",
        **{n: "127.0.0.1" for n in ("engine", "tokenizer", "detokenizer", "sampler")},
    }


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def tcp_remote_ports(inodes: set[str]) -> set[int]:
    """The remote ports of these sockets' TCP connections (/proc/net/tcp and tcp6: remote address, then inode)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            for row in list(rows)[1:]:
                fields = row.split()
                if fields[9] in inodes:
                    ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def connected_on(path: str) -> int:
    """How many connections a listener at this Unix socket path accepted and holds (/proc/net/unix, state 03)."""
    with open("/proc/net/unix") as rows:
        return sum(1 for row in list(rows)[1:] if row.split()[-1] == path and row.split()[5] == "03")


def test_the_gateway_reaches_the_services_behind_it_over_their_unix_sockets(serve):
    """Every token crosses the gateway's links to the engine and the detokenizer: serve points the gateway at each
    service's Unix socket in an owner-only directory, and its connections are there, none to their TCP ports."""
    assert collect(generate(serve.address, PROMPT, **GREEDY)).choice().finish_reason == "length"
    _, gateway_pid, _ = serve.services["gateway"]
    with open(f"/proc/{gateway_pid}/cmdline") as f:
        argv = f.read().split("\0")
    sockets = {
        flag[2:]: argv[i + 1] for i, flag in enumerate(argv) if flag in ("--engine", "--tokenizer", "--detokenizer")
    }
    assert set(sockets) == {"engine", "tokenizer", "detokenizer"}, argv
    directory = os.path.dirname(tls.unix_path(sockets["engine"]))
    assert os.stat(directory).st_mode & 0o777 == 0o700
    for name, address in sockets.items():
        assert address == f"unix:{directory}/{name}.sock"
        assert connected_on(tls.unix_path(address)) >= 1, name
    tcp_ports = {int(serve.services[name][0].rsplit(":", 1)[1]) for name in sockets}
    assert not tcp_ports & tcp_remote_ports(socket_inodes(gateway_pid))


def test_prometheus_config_names_every_service_and_log_level_reaches_them(serve, prometheus_config):
    config = yaml.safe_load(prometheus_config.read_text())
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets == {name: [metrics] for name, (_, _, metrics) in serve.services.items()}
    for name, (address,) in targets.items():
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
            assert reply.status == 200 and b"# TYPE" in reply.read(), name
    # --log-level WARNING reached every service: none logged its INFO start-up lines.
    assert not [line for line in serve.lines if line.startswith("INFO ")], "".join(serve.lines[-40:])


# A limit flag -> sampling params one past it.
SAMPLING_PAST = {
    "max_n": dict(n=over("max_n")),
    "max_stop": dict(stop=["s"] * over("max_stop")),
    "max_stop_chars": dict(stop=["s" * over("max_stop_chars")]),
    "max_stop_token_ids": dict(stop_token_ids=[1] * over("max_stop_token_ids")),
    "max_bad_words": dict(bad_words=[f"w{i}" for i in range(over("max_bad_words"))]),
    "max_bad_word_chars": dict(bad_words=["w" * over("max_bad_word_chars")]),
    "max_logit_bias": dict(logit_bias={i: 1.0 for i in range(over("max_logit_bias"))}),
    "max_allowed_token_ids": dict(allowed_token_ids=list(range(over("max_allowed_token_ids")))),
    "max_structured_output_chars": dict(
        structured_outputs=common_pb2.StructuredOutputsParams(regex="a" * over("max_structured_output_chars"))
    ),
}
VLLM_SAMPLING = {f.name for f in vllm_engine_pb2.SamplingParams.DESCRIPTOR.fields}


def refused(limit: str, rpc, request) -> None:
    """rpc(request) fails INVALID_ARGUMENT naming the limit's flag."""
    flag = "--" + limit.replace("_", "-")
    with pytest.raises(grpc.RpcError) as info:
        result = rpc(request, timeout=30)
        if hasattr(result, "__next__"):  # a stream: its error comes as it is read
            list(result)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (limit, info.value.details())
    assert re.search(rf"{flag}\b(?!-)", info.value.details()), (limit, info.value.details())


def test_each_limit_flag_is_in_force_at_the_gateway_engine_and_text_services(serve):
    assert set(LIMITS) == {f.name for f in dataclasses.fields(RequestLimits)}
    gateway = gateway_stub(serve.address)
    engine_address, tokenizer_address, detokenizer_address = (
        serve.services[n][0] for n in ("engine", "tokenizer", "detokenizer")
    )
    engine = engine_pb2_grpc.EngineStub(mesh_channel(engine_address))
    vllm = vllm_engine_pb2_grpc.VllmEngineStub(mesh_channel(engine_address, "router"))
    tokenizer = tokenizer_pb2_grpc.TokenizerStub(mesh_channel(tokenizer_address))
    ids = {"prompt_token_ids": [1, 2, 3], "request_id": "r"}
    vllm_ids = {"tokenized": vllm_engine_pb2.TokenizedInput(input_ids=[1, 2, 3]), "request_id": "r"}

    for limit, sampling in SAMPLING_PAST.items():
        params = common_pb2.SamplingParams(**sampling)
        refused(limit, gateway.Generate, gateway_pb2.GenerateRequest(text=PROMPT, sampling_params=params))
        refused(limit, engine.Generate, engine_pb2.EngineGenerateRequest(**ids, sampling_params=params))
        if set(sampling) <= VLLM_SAMPLING:
            vllm_params = vllm_engine_pb2.SamplingParams(**sampling)
            refused(limit, vllm.Generate, vllm_engine_pb2.GenerateRequest(**vllm_ids, sampling_params=vllm_params))
    vllm_params = vllm_engine_pb2.SamplingParams(regex="a" * over("max_structured_output_chars"))
    refused(
        "max_structured_output_chars",
        vllm.Generate,
        vllm_engine_pb2.GenerateRequest(**vllm_ids, sampling_params=vllm_params),
    )
    long_id = "i" * over("max_id_chars")
    for field in ("request_id", "cache_salt"):
        refused("max_id_chars", gateway.Generate, gateway_pb2.GenerateRequest(text=PROMPT, **{field: long_id}))
        refused("max_id_chars", engine.Generate, engine_pb2.EngineGenerateRequest(**{**ids, field: long_id}))
    long_text = "t" * over("max_prompt_chars")
    refused("max_prompt_chars", gateway.Generate, gateway_pb2.GenerateRequest(text=long_text))
    refused("max_prompt_chars", vllm.Generate, vllm_engine_pb2.GenerateRequest(request_id="r", text=long_text))
    refused("max_prompt_chars", tokenizer.Tokenize, tokenizer_pb2.TokenizeRequest(text=long_text))
    messages = [common_pb2.ChatMessage(role="user", content="hi")] * over("max_messages")
    refused("max_messages", gateway.Chat, gateway_pb2.ChatRequest(messages=messages))
    refused(
        "max_messages",
        tokenizer.Tokenize,
        tokenizer_pb2.TokenizeRequest(chat=tokenizer_pb2.ChatInput(messages=messages)),
    )
    batch = [tokenizer_pb2.TokenizeRequest(text="hi")] * over("max_batch")
    refused("max_batch", tokenizer.TokenizeBatch, tokenizer_pb2.TokenizeBatchRequest(requests=batch))

    # The detokenizer: a batch past --max-batch ends its stream; an item past another limit fails alone.
    detokenizer = detokenizer_pb2_grpc.DetokenizerStub(mesh_channel(detokenizer_address))
    closes = [detokenizer_pb2.DetokenizeItem(request_id=f"c{i}", close=True) for i in range(over("max_batch"))]
    refused("max_batch", detokenizer.Detokenize, iter([detokenizer_pb2.DetokenizeBatch(items=closes)]))

    def start(rid: str, **fields) -> detokenizer_pb2.DetokenizeItem:
        return detokenizer_pb2.DetokenizeItem(
            request_id=rid, start=detokenizer_pb2.DetokenizeStart(prompt_token_ids=[1, 2], **fields)
        )

    bad = detokenizer_pb2.DetokenizeBatch(items=[start(long_id), start("s", stop=["s"] * over("max_stop"))])
    opens = [detokenizer_pb2.DetokenizeBatch(items=[start(f"r{i}")]) for i in range(over("max_open_requests"))]
    errors = [r.error for reply in detokenizer.Detokenize(iter([bad, *opens]), timeout=30) for r in reply.results]
    assert errors[2:-1] == [""] * LIMITS["max_open_requests"], errors
    for error, flag in zip([*errors[:2], errors[-1]], ("max-id-chars", "max-stop", "max-open-requests"), strict=True):
        assert re.search(rf"--{flag}\b(?!-)", error), (flag, errors)
    # None of this troubled the mesh.
    assert collect(generate(serve.address, PROMPT, **GREEDY)).choice().finish_reason == "length"


def test_engine_killed_mid_stream_is_restarted_and_serves_the_same(serve):
    before = collect(generate(serve.address, PROMPT, **GREEDY))
    address, pid, metrics = serve.services["engine"]
    stream = generate(serve.address, PROMPT, timeout=WAIT_S, **LONG)
    next(stream), next(stream)  # it is running in the engine
    with mesh_channel(serve.address) as channel:
        # Watched from before the kill, so no state the gateway goes through is missed.
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
        assert next(watch).status == SERVING
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as info:
            collect(stream)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
        assert "engine" in info.value.details(), info.value.details()
        # At once: not when the engine was back (whose new process never heard of this request), nor at the deadline.
        assert not any("the engine is serving again" in line for line in serve.lines)
        assert next(watch).status == NOT_SERVING  # while the engine is down
        serve.expect(r"the engine exited \(killed by SIGKILL\); starting it again in")
        assert next(watch).status == SERVING
        watch.cancel()
    name, new_address, new_pid, new_metrics = serve.expect(SERVING_LINE).groups()
    assert (name, new_address, new_metrics) == ("engine", address, metrics) and int(new_pid) != pid
    serve.services["engine"] = (address, int(new_pid), metrics)
    after = collect(generate(serve.address, PROMPT, **GREEDY))
    assert after.token_ids == before.token_ids and after.text() == before.text()
    assert serve.popen.poll() is None


def test_gateway_killed_comes_back_on_its_ports(serve):
    address, pid, metrics = serve.services["gateway"]
    os.kill(pid, signal.SIGKILL)
    serve.expect(r"the gateway exited \(killed by SIGKILL\)")
    name, new_address, new_pid, new_metrics = serve.expect(SERVING_LINE).groups()
    new_address = new_address.replace("0.0.0.0:", "127.0.0.1:")
    assert (name, new_address, new_metrics) == ("gateway", address, metrics)
    serve.services["gateway"] = (address, int(new_pid), metrics)
    wait_for_health(address, SERVING)
    assert collect(generate(address, PROMPT, **GREEDY)).choice().finish_reason == "length"


def test_a_crash_loop_stops_the_mesh_with_a_message(serve):
    """Last: the detokenizer killed each time it is started again, MAX_RESTARTS times and once more."""
    pid = serve.services["detokenizer"][1]
    for _ in range(supervisor.MAX_RESTARTS):
        os.kill(pid, signal.SIGKILL)
        pid = int(serve.expect(r"started the detokenizer again \(pid (\d+)\)").group(1))
    os.kill(pid, signal.SIGKILL)
    message = serve.expect(r"the detokenizer exited .*a crash loop.*").group(0)
    assert f"after {supervisor.MAX_RESTARTS} restarts within {supervisor.RESTART_WINDOW_S:g} s" in message
    assert serve.popen.wait(WAIT_S) == 1
    serve.expect("llmmesh serve: stopped")
