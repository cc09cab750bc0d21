"""Shared fixtures: the real SmolLM2 model, and Hugging Face transformers as the oracle."""

import collections
import dataclasses
import functools
import os
import signal

import pytest
import torch

# Without a GPU, Triton kernels run under its interpreter, which must be on before any @triton.jit runs.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.config import EngineArgs
from engine.models.files import DEFAULT_MODEL, load_tokenizer, resolve_model
from engine.models.loader import prepare_model_dir

# The suite checks engines against Hugging Face in float32 and sizes KV caches in float32 blocks: an engine built
# here without a dtype computes in float32, not in what --dtype auto picks for this CPU (bfloat16 where it computes
# that natively). The tests of auto and of bfloat16 name their dtype. EngineArgs() and LLM() take the default of
# EngineArgs.__init__; the services' --dtype (in this process or in a child) the LLMMESH_DTYPE variable.
_defaults = EngineArgs.__init__.__defaults__
_names = [f.name for f in dataclasses.fields(EngineArgs)][-len(_defaults) :]
EngineArgs.__init__.__defaults__ = tuple("float32" if n == "dtype" else d for n, d in zip(_names, _defaults))
os.environ.setdefault("LLMMESH_DTYPE", "float32")
# One KV block key for every engine the tests start, in process or not, as `llmmesh serve` gives its engines one:
# engines that share a KV store load each other's blocks.
os.environ.setdefault("LLMMESH_KV_BLOCK_KEY", os.urandom(32).hex())

# One float32 KV block of SmolLM2: K and V x 30 layers x 16 tokens x 3 KV heads x 64 dims x 4 bytes.
SMOLLM2_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4

# Where greedy choices differ, the reference's top two logits there must be this close (DESIGN §6).
NEAR_TIE = 1e-3


# Under `make test` (--dist loadfile) each process takes the next file when it finishes one. These files take
# longest (one to six minutes each on a 2-core machine, most starting meshes or engines of their own): they go
# first, so that none is left running alone at the end. The rest follow with the most tests first, as xdist orders
# files by default (pyproject.toml turns that off, so that this order holds).
LONGEST_FIRST = [
    "test_correctness.py",
    "test_hostile.py",
    "test_kv_connector.py",
    "test_routing.py",
    "test_sampler_service.py",
    "test_watchdog.py",
    "test_migration.py",
    "test_disaggregation.py",
    "test_serve.py",
    "test_kv_cache_dtype.py",
    "test_docs.py",
    "test_interop.py",
    "test_mesh.py",
    "test_prometheus.py",
    "test_drain.py",
    "test_async_scheduling.py",
]


def pytest_collection_modifyitems(config, items):
    tests_in = collections.Counter(item.path for item in items)
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    # A stable sort: each file's tests stay together and in their order.
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -tests_in[item.path]))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def mesh_credentials(tmp_path_factory):
    """The suite's mesh credentials (services/certs.py), made once: every service a test starts, in this process or
    as a child, serves mutual TLS with them (LLMMESH_TLS_DIR), as `llmmesh serve` does by default."""
    from services.certs import make_credentials

    path = tmp_path_factory.mktemp("mesh-tls")
    make_credentials(path)
    os.environ["LLMMESH_TLS_DIR"] = str(path)
    return path


def mesh_credentials_of(identity: str):
    from mesh import tls

    return tls.MeshCredentials(os.environ["LLMMESH_TLS_DIR"], identity)


def server_identity(address: str, timeout: float = 10.0) -> str:
    """The mesh identity in the certificate of the server at address (a TLS handshake of its own): a test's channel
    names the service it reaches, as the mesh's own channels do, without each test saying which one it is."""
    import socket
    import ssl

    from mesh import tls

    credentials = mesh_credentials_of("gateway")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False  # what is read here is the name itself; the CA is still checked
    context.load_verify_locations(cadata=credentials.ca().decode())
    directory = credentials.tls_dir
    context.load_cert_chain(os.path.join(directory, "gateway.crt"), os.path.join(directory, "gateway.key"))
    context.set_alpn_protocols(["h2"])
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host.strip("[]"), int(port)), timeout) as sock:
        with context.wrap_socket(sock) as secure:
            names = [value for kind, value in secure.getpeercert().get("subjectAltName", ()) if kind == "DNS"]
    identity = tls.peer_identity({"x509_subject_alternative_name": names})
    assert identity is not None, f"the server at {address} has no mesh identity: {names}"
    return identity


def caller(server: str) -> str:
    """An identity that may call the service `server` (the gateway's public port takes any)."""
    from mesh import tls

    main = {"engine": "Engine", "tokenizer": "Tokenizer", "detokenizer": "Detokenizer", "kvstore": "KVStore"}
    main["sampler"] = "Sampler"
    return tls.CALLERS[f"llmmesh.v1.{main[server]}"][0] if server in main else "gateway"


def mesh_channel(address: str, identity: str | None = None, options=(), server: str | None = None):
    """A blocking channel to the service at address (`server`, default: the identity its certificate names) with the
    suite's certificate of `identity` (default: the first that mesh/tls.py lets call it: the gateway for an engine);
    options: channel options over the mesh's own."""
    from mesh import tls

    server = server or server_identity(address)
    credentials = mesh_credentials_of(identity or caller(server))
    return grpc.secure_channel(
        address,
        credentials.channel_credentials(),
        options=list({**dict(tls.channel_options(server)), **dict(options)}.items()),
    )


def aio_mesh_channel(address: str, identity: str | None = None, options=(), server: str | None = None):
    """mesh_channel for asyncio."""
    from mesh import tls

    server = server or server_identity(address)
    credentials = mesh_credentials_of(identity or caller(server))
    return grpc.aio.secure_channel(
        address,
        credentials.channel_credentials(),
        options=list({**dict(tls.channel_options(server)), **dict(options)}.items()),
    )


@pytest.fixture(scope="session")
def smollm2_dir():
    return prepare_model_dir(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random Llama of test_models.COMMON's shape, with a word-level tokenizer of "<i>" tokens."""
    from random_model import save_random_smollm2_shaped
    from test_models import COMMON

    path = tmp_path_factory.mktemp("tiny-llama")
    save_random_smollm2_shaped(path, **COMMON)
    return path


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    return load_tokenizer(smollm2_dir)


class HFReference:
    """Greedy generation (EOS off, so exactly max_new_tokens) and the logits behind each choice."""

    def __init__(self, model):
        self.model = model

    @functools.cache  # noqa: B019 (one instance for the whole session: nothing to leak)
    def _greedy(self, prompt: tuple[int, ...], max_new_tokens: int):
        ids = torch.tensor([prompt], device=self.model.device)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        tokens = out.sequences[0, len(prompt) :].tolist()
        logits = torch.stack([step[0] for step in out.logits]).float().cpu()
        return tokens, logits

    def greedy(self, prompt, max_new_tokens):
        return self._greedy(tuple(prompt), max_new_tokens)


@pytest.fixture(scope="session")
def hf_smollm2_dir(tmp_path_factory):
    """transformers' own float32 dequantization of the GGUF, independent of our converter, saved as a Hugging Face
    directory. Reading the GGUF takes transformers half a minute on a 2-core machine: the first process of a run
    (`make test` has two) saves what it read, and every load after that (the other process, other dtypes) reads
    those same weights, bit for bit, in under a second."""
    import fcntl

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = run_dir.parent  # the run's directory, above each process's own
    path = run_dir / "hf-smollm2-float32"
    with open(run_dir / "hf-smollm2-float32.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            gguf = resolve_model(DEFAULT_MODEL)
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            partial = run_dir / "hf-smollm2-float32.partial"
            partial.mkdir(exist_ok=True)
            # save_pretrained refuses a model read from a GGUF: what from_pretrained needs, written one by one
            save_model(model, str(partial / "model.safetensors"))
            model.config.save_pretrained(partial)
            model.generation_config.save_pretrained(partial)
            os.rename(partial, path)
    return path


def hf_smollm2_in(path, dtype: torch.dtype) -> HFReference:
    """The reference of hf_smollm2_dir, computing in dtype (its float32 weights rounded to dtype on load, as
    transformers rounds them when it loads the GGUF in dtype)."""
    from transformers import AutoModelForCausalLM

    return HFReference(AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval())


@pytest.fixture(scope="session")
def hf_smollm2(hf_smollm2_dir):
    return hf_smollm2_in(hf_smollm2_dir, torch.float32)


def assert_greedy_matches(
    ours: list[int], reference: list[int], ref_logits: torch.Tensor, label="", near_tie=NEAR_TIE, relative=False
):
    """Token-identical, except that after a near-tie in the reference the two may diverge: its top two logits there
    at most near_tie apart (relative: near_tie times the top logit's magnitude)."""
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            gap = (top2[0] - top2[1]).item()
            bound = near_tie * abs(top2[0].item()) if relative else near_tie
            assert gap <= bound, (
                f"{label}: token {i} differs ({a} vs reference {b}) and is no near-tie (gap {gap:.4g} > {bound:.4g})"
            )
            return False
    assert len(ours) == len(reference), f"{label}: {len(ours)} tokens vs reference {len(reference)}"
    return True


def run_greedy(engine, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    """Drive an EngineCore step by step over greedy requests (max_tokens: for all, or one per prompt); the tokens
    of each, in order."""
    from engine.request import Request, SamplingParams

    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    for i, (prompt, n) in enumerate(zip(prompts, limits)):
        engine.add_request(Request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    tokens = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def run_to_completion(engine, requests) -> tuple[dict[str, list[int]], dict]:
    """Add the requests to an EngineCore and step it until nothing is left, which must leak nothing: each
    request's tokens, and the output that finished it."""
    for request in requests:
        engine.add_request(request)
    tokens, ends = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                ends[out.request_id] = out
    assert_no_leaks(engine)
    return tokens, ends


def assert_no_leaks(engine):
    """No request left, and every block free (or free and still cached)."""
    assert not engine.scheduler.requests
    assert not engine.scheduler.running and len(engine.scheduler.waiting) == 0
    manager = engine.kv_cache_manager
    assert not manager.req_to_blocks
    assert manager.get_num_free_blocks() == manager.num_blocks
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


# ---- services in this process, and health as an event -------------------------------------------


import asyncio  # noqa: E402
import contextvars  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

# Set on an InProcessService's thread: how its server hands itself over once it announces itself.
_ON_SERVING = contextvars.ContextVar("llmmesh_test_on_serving", default=None)


def _observe_servers() -> None:
    """Wrap Server.set_serving once, as an observer: a server run by an InProcessService reports itself (and
    its event loop) the first time it says SERVING, the moment a process prints its "listening on" line."""
    from services.server import Server

    if getattr(Server.set_serving, "observed_by_tests", False):
        return
    set_serving = Server.set_serving

    async def observed(self, serving: bool) -> None:
        await set_serving(self, serving)
        report = _ON_SERVING.get()
        if report is not None and self.announced:
            report(self, asyncio.get_running_loop())

    observed.observed_by_tests = True
    Server.set_serving = observed


class InProcessService:
    """`llmmesh <service> <flags>` served from this process, on port 0 unless the flags say otherwise.

    The service's own command runs (the same parser, LLMMESH_* variables and serve()), on a thread with its own
    event loop, so a test's blocking gRPC calls can reach it. stop() does what SIGTERM does: the server drains
    and serve() returns. For tests that need a server but no kill or signal; services.service_process.ServiceProcess
    runs the same command as a process for those that do."""

    def __init__(self, service: str, flags=(), timeout: float = 600.0):
        from services.cli import build_parser

        _observe_servers()
        self.service = service
        self.args = build_parser().parse_args([service, "--port", "0", *map(str, flags)])
        self.server = self.loop = self.error = None
        self.address: str | None = None
        self._ready = threading.Event()  # serving, or the command ended
        self.thread = threading.Thread(target=self._run, name=f"in-process-{service}", daemon=True)
        self.thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"the in-process {service} was not serving after {timeout:.0f} s")
        if self.server is None:
            raise RuntimeError(f"the in-process {service} ended before it was serving") from self.error

    def _run(self) -> None:
        def on_serving(server, loop):
            if self.server is None:
                self.server, self.loop, self.address = server, loop, server.address
                self._ready.set()

        _ON_SERVING.set(on_serving)  # asyncio.run copies this thread's context into the service's tasks
        try:
            self.args.func(self.args)
        except BaseException as e:  # noqa: BLE001 (reported by __init__ or stop)
            self.error = e
        finally:
            self._ready.set()

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Wait for the service to end on its own (an engine whose core died); the code its process would exit with."""
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the in-process {self.service} did not end within {timeout:.0f} s"
        error, self.error = self.error, None
        assert isinstance(error, SystemExit), f"the in-process {self.service} ended with {error!r}"
        return error.code

    def stop(self, timeout: float = 60.0) -> None:
        if self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.server.stop_requested.set)
            self.thread.join(timeout)
        assert not self.thread.is_alive(), f"the in-process {self.service} did not stop within {timeout:.0f} s"
        if self.error is not None:
            raise RuntimeError(f"the in-process {self.service} failed") from self.error

    def __enter__(self) -> "InProcessService":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_until(condition, timeout: float = 60.0, interval: float = 0.05) -> None:
    """Poll condition() every `interval` s until it holds; fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"the condition did not hold within {timeout:g} s"
        time.sleep(interval)


def freeze(pid: int) -> None:
    """SIGSTOP the process and wait until every thread of it has stopped: one already running (a native loop woken by
    a message) stops only once the stop reaches it."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:  # a thread that ended
                pass
        return all(state in "tT" for state in states)

    wait_until(stopped, interval=0.001)


def wait_for_health(
    address: str, status=SERVING, timeout: float = 60.0, service: str = "", server: str | None = None
) -> None:
    """Block until the server at address (the identity `server`, default: the one it names once it listens) reports
    `status` for `service` ("" = the whole server): a
    Health.Watch stream, which also waits for a server that is not listening yet. Fails after timeout."""
    deadline = time.monotonic() + timeout
    while server is None:
        try:
            server = server_identity(address)
        except OSError:  # not listening yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    with mesh_channel(address, server=server) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
        )
        seen = []
        try:
            for reply in watch:
                seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                if reply.status == status:
                    return
        except grpc.RpcError as e:
            raise AssertionError(
                f"{address} never reported {health_pb2.HealthCheckResponse.ServingStatus.Name(status)} "
                f"(saw {seen}): {e.code().name} {e.details()}"
            ) from None
        finally:
            watch.cancel()


def undecodable(message_type, seed: int = 0) -> bytes:
    """Random bytes (seeded) that do not parse as message_type: a request gRPC delivers but protobuf refuses."""
    import random

    from google.protobuf.message import DecodeError

    rng = random.Random(seed)
    while True:
        data = rng.randbytes(48)
        try:
            message_type.FromString(data)
        except DecodeError:
            return data


# ---- Redis for the KV store ---------------------------------------------------------------------------


@pytest.fixture
def redis_server():
    """A fresh, empty `redis-server` of this test's own (services.redis_server.RedisServer) on a free loopback port:
    `.url`, `.port`; `.kill()` then `.start()` brings it back, empty, on the same port. Stopped after the test."""
    from services.redis_server import RedisServer

    with RedisServer(maxmemory="256mb") as server:
        yield server


def loading_kv_config(kvstore_address: str, role: str = "kv_both") -> str:
    """An engine's --kv-transfer-config to the kvstore at kvstore_address that loads every block it finds. A lookup
    past its default half second is a miss by design; on a loaded 2-core machine it can be, and the tests that use
    this ask whether blocks load, not how fast."""
    from services.local_mesh import kv_transfer_config

    return kv_transfer_config(kvstore_address, role, load_policy="always", lookup_timeout_s=10.0)
