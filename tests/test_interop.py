"""Clients and routers that are not ours, against the real mesh on loopback (its services served in-process).

- Node.js: a client generated from our protos by @grpc/grpc-js's own loader streams a greedy Generate
  through the gateway; its text equals the offline LLM's and the Python client's.
- smg (the PyPI router, `smg launch --worker-urls grpc://…`): it speaks vLLM's gRPC engine protocol
  (vllm.grpc.engine.VllmEngine) to our engine and serves OpenAI-compatible chat completions over
  HTTP; its greedy text equals our own gateway's Chat text for the same messages.
"""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

from conftest import InProcessService
from engine import LLM, SamplingParams
from engine.models.loader import DEFAULT_MODEL, prepare_model_dir
from services.client import chat, collect, generate

pytestmark = pytest.mark.slow

KV = "256MiB"
NODE_DIR = Path(__file__).parent / "interop" / "node"
PROMPT = "def quicksort(items):"
MAX_TOKENS = 24
CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]
CHAT_MAX_TOKENS = 16
# smg's console script sits beside this Python (the venv's bin/), which need not be on PATH.
SMG = shutil.which("smg", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


class InProcessMesh:
    """The engines ("engine", "engine-2"...), tokenizer and detokenizer, and a gateway in front of them, each served
    in-process."""

    def __init__(self, engine_flags: list[str], num_engines: int = 1):
        self.services: dict[str, InProcessService] = {}
        self.engine_names = ["engine"] + [f"engine-{i}" for i in range(2, num_engines + 1)]
        # smg reaches workers in plaintext only: each engine's VllmEngine on a plaintext loopback port for it
        self.vllm_addresses = {name: f"127.0.0.1:{free_port()}" for name in self.engine_names}
        try:
            for name in self.engine_names:
                plain = ["--vllm-plaintext-port", self.vllm_addresses[name].rsplit(":", 1)[1]]
                self.services[name] = InProcessService("engine", [*engine_flags, *plain, "--shutdown-timeout", "5"])
            for name in ("tokenizer", "detokenizer"):
                self.services[name] = InProcessService(name, ["--shutdown-timeout", "5"])
            backends = [
                f
                for name in (*self.engine_names, "tokenizer", "detokenizer")
                for f in (f"--{self.services[name].service}", self.services[name].address)
            ]
            self.services["gateway"] = InProcessService("gateway", [*backends, "--shutdown-timeout", "5"])
        except BaseException:
            self.stop()
            raise

    @property
    def address(self) -> str:
        return self.services["gateway"].address

    def stop(self) -> None:
        for service in reversed(self.services.values()):  # the gateway first
            service.stop()


@pytest.fixture(scope="module")
def mesh():
    m = InProcessMesh(["--kv-cache-memory", KV])
    yield m
    m.stop()


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=KV)


# ---- Node.js --------------------------------------------------------------------------------------


def node_missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not installed: the Node.js interop client cannot run"
    if (
        not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir()
        or not (NODE_DIR / "node_modules" / "@grpc" / "proto-loader").is_dir()
    ):
        return f"{NODE_DIR}/node_modules is missing: run `make setup` (npm ci --prefix {NODE_DIR})"
    return None


def node_generate(address: str, prompt: str, max_tokens: int) -> dict:
    done = subprocess.run(
        ["node", str(NODE_DIR / "generate.js"), address, prompt, str(max_tokens)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"node client failed ({done.returncode}): {done.stderr}"
    return json.loads(done.stdout)


@pytest.mark.skipif(node_missing() is not None, reason=str(node_missing()))
def test_node_client_streams_generate(mesh, llm):
    node = node_generate(mesh.address, PROMPT, MAX_TOKENS)
    python = collect(generate(mesh.address, PROMPT, temperature=0.0, max_tokens=MAX_TOKENS))
    offline = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)[0].outputs[
        0
    ]

    assert offline.text, "the offline reference produced no text"
    assert node["text"] == offline.text
    assert node["text"] == python.text()
    assert node["token_ids"] == list(offline.token_ids)
    assert node["finish_reason"] == offline.finish_reason == python.choice().finish_reason
    assert node["chunks"] > 1, "the Node client got the whole text in one message: it did not stream"


# ---- smg ------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(url: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class SmgRouter:
    """`smg launch` in front of engines, on free loopback ports (extra: further smg flags)."""

    def __init__(self, engine_addresses: list[str], model_dir: Path | None, log: Path, extra: list[str] = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_workers = len(engine_addresses)
        self.log = log
        self.popen = subprocess.Popen(
            [
                SMG,
                "launch",
                "--worker-urls",
                *[f"grpc://{address}" for address in engine_addresses],
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
                *(["--model-path", str(model_dir)] if model_dir is not None else []),
                "--log-level",
                "info",
                *extra,
            ],
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 90.0) -> str:
        """Wait until the router lists the engine's model and has its tokenizer (a one-token chat
        completes: smg registers the tokenizer after the worker); returns the model id. smg announces neither
        over anything but its log, so this polls its HTTP API."""
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"smg exited with {self.popen.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                models = http_json(f"{self.url}/v1/models", timeout=5.0).get("data", [])
                # Every engine registered: a policy set up with one worker would route everything there.
                workers = http_json(f"{self.url}/workers", timeout=5.0).get("total", 0)
                if models and workers == self.num_workers:
                    model = models[0]["id"]
                    http_json(
                        f"{self.url}/v1/chat/completions",
                        {
                            "model": model,
                            "messages": [{"role": "user", "content": "Hi"}],
                            "max_tokens": 1,
                        },
                        timeout=30.0,
                    )
                    return model
            except urllib.error.HTTPError as e:  # e.g. 503 tokenizer_not_ready while it registers
                last = f"HTTP {e.code}: {e.read().decode(errors='replace')[:500]}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError) as e:
                last = repr(e)
            time.sleep(0.5)
        raise TimeoutError(f"smg was not ready after {timeout:.0f} s ({last}):\n{self.log.read_text()[-4000:]}")

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


def smg_missing() -> str | None:
    if importlib.util.find_spec("services.vllm_engine") is None:
        return (
            "VllmEngine is missing: services/vllm_engine.py (the engine's vllm.grpc.engine.VllmEngine) does not exist"
        )
    if SMG is None:
        return "smg is not installed: pip install smg==1.13.0 (in the dev extra)"
    return None


@pytest.fixture(scope="module")
def smg(mesh, tmp_path_factory):
    reason = smg_missing()
    if reason:
        pytest.skip(reason)
    router = SmgRouter(
        [mesh.vllm_addresses["engine"]], prepare_model_dir(DEFAULT_MODEL), tmp_path_factory.mktemp("smg") / "smg.log"
    )
    try:
        model = router.wait_ready()
        yield router, model
    finally:
        router.stop()


def sse_events(url: str, body: dict, timeout: float = 60.0) -> list[dict]:
    """POST with stream=true; the JSON of each `data:` event up to [DONE]."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data:") and line != "data: [DONE]":
                events.append(json.loads(line[len("data:") :]))
    return events


def smg_chat(model: str, **extra) -> dict:
    return {"model": model, "messages": CHAT, "temperature": 0, "max_tokens": CHAT_MAX_TOKENS, **extra}


def test_smg_chat_completion_matches_gateway(mesh, smg):
    router, model = smg
    reply = http_json(f"{router.url}/v1/chat/completions", smg_chat(model, stream=False))
    ours = collect(chat(mesh.address, CHAT, temperature=0.0, max_tokens=CHAT_MAX_TOKENS))

    choice = reply["choices"][0]
    assert ours.text(), "our gateway produced no text"
    assert choice["message"]["content"] == ours.text()
    assert choice["finish_reason"] == ours.choice().finish_reason
    # The same chat template on both sides: the same prompt, token for token.
    assert reply["usage"]["prompt_tokens"] == ours.complete.usage.prompt_tokens
    assert reply["usage"]["completion_tokens"] == ours.complete.usage.completion_tokens


def test_smg_streamed_chat_matches_gateway(mesh, smg):
    """Streaming goes through the engine's chunk + complete messages: no token lost or doubled."""
    router, model = smg
    events = sse_events(f"{router.url}/v1/chat/completions", smg_chat(model, stream=True))
    ours = collect(chat(mesh.address, CHAT, temperature=0.0, max_tokens=CHAT_MAX_TOKENS))

    deltas = [c["delta"].get("content") or "" for e in events for c in e.get("choices", [])]
    finish = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    assert sum(1 for d in deltas if d) > 1, "smg sent the whole text in one event: it did not stream"
    assert "".join(deltas) == ours.text()
    assert finish == [ours.choice().finish_reason]


# ---- smg over two engines ---------------------------------------------------------------------------------

# Two system prompts, two questions each: smg's cache-aware policy sees two prefixes to place.
CONVERSATIONS = [
    [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for question in ("Name a colour.", "Name a fruit.")
    for system in ("You are a helpful assistant.", "You answer in one short sentence, politely and precisely.")
]


@pytest.fixture(scope="module")
def two_engines():
    m = InProcessMesh(["--kv-cache-memory", KV, "--enable-kv-cache-events"], num_engines=2)
    yield m
    m.stop()


def test_smg_cache_aware_over_two_engines_matches_gateway(two_engines, tmp_path):
    """smg with its cache-aware policy in front of two of our engines (their KV events on): every reply equals our
    gateway's over the same two engines, and a burst of requests in flight together reaches both engines."""
    reason = smg_missing()
    if reason:
        pytest.skip(reason)
    addresses = [two_engines.vllm_addresses[name] for name in two_engines.engine_names]
    router = SmgRouter(addresses, prepare_model_dir(DEFAULT_MODEL), tmp_path / "smg.log", ["--policy", "cache_aware"])
    try:
        model = router.wait_ready()
        for messages in CONVERSATIONS:
            body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": CHAT_MAX_TOKENS}
            reply = http_json(f"{router.url}/v1/chat/completions", body)
            ours = collect(chat(two_engines.address, messages, temperature=0.0, max_tokens=CHAT_MAX_TOKENS))
            assert ours.text(), "our gateway produced no text"
            assert reply["choices"][0]["message"]["content"] == ours.text(), messages
        # A request that overlaps no engine's cached blocks goes to the least loaded engine, the first of them on a
        # tie: one at a time, every such request may go to the same engine. Requests in flight together spread.
        # Each burst prompt differs from the others within its first block, so none overlaps another's blocks.
        burst = [
            [
                {"role": "system", "content": f"Rule {n}: answer in one word."},
                {"role": "user", "content": "Name a fruit."},
            ]
            for n in range(8)
        ]
        with ThreadPoolExecutor(len(burst)) as pool:
            replies = list(
                pool.map(
                    lambda messages: http_json(
                        f"{router.url}/v1/chat/completions",
                        {"model": model, "messages": messages, "temperature": 0, "max_tokens": CHAT_MAX_TOKENS},
                    ),
                    burst,
                )
            )
        assert all(r["choices"][0]["message"]["content"] for r in replies), replies
    finally:
        router.stop()
    for address in addresses:  # each engine's VllmEngine saw a Generate from smg
        with grpc.insecure_channel(address) as channel:
            info = vllm_engine_pb2_grpc.VllmEngineStub(channel).GetServerInfo(vllm_engine_pb2.GetServerInfoRequest())
        assert info.last_receive_timestamp > 0, f"smg sent nothing to the engine at {address}"
