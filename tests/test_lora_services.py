"""LoRA adapters through the services: the gateway's `model` names an adapter, the engines' LoadLoraAdapter /
UnloadLoraAdapter / ListLoraAdapters, ListModels, vllm:lora_requests_info, refusals. A mesh of two engines (tiny random
model, small random PEFT adapters made here), served in-process on loopback; outputs are checked against the offline
LLM with the same adapter."""

import copy
import random
import time
import urllib.request

import grpc
import pytest
from test_telemetry import Receiver

from conftest import InProcessService, mesh_channel, wait_until
from engine import LLM, EngineArgs, LoRARequest, SamplingParams
from llmmesh.v1 import common_pb2, engine_pb2, engine_pb2_grpc, gateway_pb2, gateway_pb2_grpc
from random_model import save_random_smollm2_shaped
from services import client
from services.cli import build_parser
from services.gateway import Gateway
from services.local_mesh import engine_flags
from test_models import COMMON

KV = "16MiB"
MAX_TOKENS = 8
MAX_LORA_RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(base, path, rank: int, seed: int) -> str:
    """A PEFT LoRA adapter of `base` with random A and B (PEFT's own initialisation leaves B at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
    get_peft_model(copy.deepcopy(base), config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-services")
    base = save_random_smollm2_shaped(root / "base", **COMMON)
    adapters = {
        "sql": save_random_adapter(base, root / "sql", rank=8, seed=1),
        "late": save_random_adapter(base, root / "late", rank=4, seed=2),
        "too-big": save_random_adapter(base, root / "too-big", rank=2 * MAX_LORA_RANK, seed=3),
    }
    return root / "base", adapters


def lora_flags(model_dir, adapters) -> list[str]:
    return [
        "--model", str(model_dir), "--kv-cache-memory", KV, "--enable-lora", "--max-loras", "2",
        "--max-lora-rank", str(MAX_LORA_RANK), "--lora-modules", f"sql={adapters['sql']}", "--enable-kv-cache-events", "--shutdown-timeout", "5",
        "--allow-runtime-lora-updating", "--lora-root", str(model_dir.parent),
    ]  # fmt: skip


class LoraMesh:
    """Two engines with the `sql` adapter (one with metrics), the text services and a gateway (prefix-aware routing
    over the engines' KV events), in this process; the gateway and the engines trace to `receiver`."""

    def __init__(self, model_dir, adapters, receiver: Receiver):
        flags = lora_flags(model_dir, adapters)
        tracing = ["--otlp-traces-endpoint", f"127.0.0.1:{receiver.port}"]
        self.services = {}
        try:
            self.services["engine"] = InProcessService("engine", [*flags, *tracing, "--metrics-port", "0"])
            self.services["engine-2"] = InProcessService("engine", [*flags, *tracing])
            for name in ("tokenizer", "detokenizer"):
                self.services[name] = InProcessService(name, ["--model", str(model_dir), "--shutdown-timeout", "5"])
            backends = [
                flag for name, service in self.services.items() for flag in (f"--{service.service}", service.address)
            ]
            self.services["gateway"] = InProcessService("gateway", [*backends, *tracing, "--shutdown-timeout", "5"])
        except BaseException:
            self.stop()
            raise
        self.channels = {name: mesh_channel(s.address) for name, s in self.services.items()}
        self.gateway = gateway_pb2_grpc.GatewayStub(self.channels["gateway"])
        self.engines = {name: engine_pb2_grpc.EngineStub(self.channels[name]) for name in ("engine", "engine-2")}

    def stop(self) -> None:
        for channel in getattr(self, "channels", {}).values():
            channel.close()
        for service in reversed(self.services.values()):
            service.stop()


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.server.stop(0)


@pytest.fixture(scope="module")
def mesh(model_dir, receiver):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export spans every 50 ms, not every 5 s
        m = LoraMesh(*model_dir, receiver)
    yield m
    m.stop()


@pytest.fixture(scope="module")
def offline(model_dir):
    path, adapters = model_dir
    llm = LLM(model=str(path), kv_cache_memory=KV, enable_lora=True, max_loras=2, max_lora_rank=MAX_LORA_RANK)
    ids = {"sql": 1, "late": 2}

    def generate(prompt: list[int], lora_name: str = "", max_tokens: int = MAX_TOKENS) -> list[int]:
        lora = LoRARequest(lora_name, ids[lora_name], adapters[lora_name]) if lora_name else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        out = llm.generate({"prompt_token_ids": prompt}, params, lora_request=lora, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    return generate


def prompt(seed: int, length: int = 20) -> list[int]:
    return random.Random(seed).choices(range(3, COMMON["vocab_size"]), k=length)


def through_gateway(mesh, tokens: list[int], model: str = "", max_tokens: int = MAX_TOKENS) -> list[int]:
    responses = client.generate(
        mesh.services["gateway"].address, tokens, model=model, temperature=0.0, max_tokens=max_tokens, ignore_eos=True
    )
    return client.collect(responses).token_ids[0]


def assert_each_engine_serves_sql(mesh, offline, tokens: list[int]) -> None:
    params = client.sampling_params(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = engine_pb2.EngineGenerateRequest(prompt_token_ids=tokens, sampling_params=params, lora_name="sql")
    for stub in mesh.engines.values():
        received = [t for m in stub.Generate(request, timeout=60) for c in m.outputs for t in c.token_ids]
        assert received == offline(tokens, "sql")


def model_cards(mesh) -> dict[str, gateway_pb2.ModelCard]:
    return {card.id: card for card in mesh.gateway.ListModels(gateway_pb2.ListModelsRequest(), timeout=10).models}


def adapter_names(stub) -> list[str]:
    return [a.lora_name for a in stub.ListLoraAdapters(engine_pb2.ListLoraAdaptersRequest(), timeout=10).adapters]


def test_model_names_the_adapter_through_the_mesh(mesh, offline):
    wait_until(lambda: "sql" in model_cards(mesh))
    for seed in range(3):
        tokens = prompt(seed)
        base, sql = offline(tokens), offline(tokens, "sql")
        assert base != sql, "the adapter changed nothing: the test could not tell them apart"
        assert through_gateway(mesh, tokens, model="sql") == sql
        assert through_gateway(mesh, tokens) == base
    assert_each_engine_serves_sql(mesh, offline, prompt(10))  # straight to each engine: lora_name on Engine/Generate


def test_list_models_lists_adapters_beside_the_base_model(mesh, model_dir):
    path, adapters = model_dir
    wait_until(lambda: "sql" in model_cards(mesh))
    cards = model_cards(mesh)
    base = cards.pop(str(path))
    assert (base.root, base.parent) == (str(path), "")
    assert list(cards) == ["sql"]
    assert (cards["sql"].root, cards["sql"].parent) == ("sql", str(path))  # no adapter's path
    info = mesh.engines["engine"].GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=10)
    assert (info.enable_lora, info.max_loras, info.max_lora_rank) == (True, 2, MAX_LORA_RANK)


def test_load_and_unload_at_run_time_on_every_engine(mesh, model_dir, offline):
    _, adapters = model_dir
    load = common_pb2.LoadLoraAdapterRequest(lora_name="late", lora_path=adapters["late"])
    mesh.gateway.LoadLoraAdapter(load, timeout=60)
    assert all("late" in adapter_names(stub) for stub in mesh.engines.values())
    assert model_cards(mesh)["late"].root == "late"
    tokens = prompt(20)
    assert through_gateway(mesh, tokens, model="late") == offline(tokens, "late")

    with pytest.raises(grpc.RpcError) as e:
        mesh.gateway.LoadLoraAdapter(load, timeout=60)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "late" in e.value.details()

    mesh.gateway.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(lora_name="late"), timeout=60)
    assert not any("late" in adapter_names(stub) for stub in mesh.engines.values())
    assert "late" not in model_cards(mesh)
    with pytest.raises(grpc.RpcError) as e:
        through_gateway(mesh, tokens, model="late")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'sql'" in e.value.details()


@pytest.mark.parametrize(
    "lora_name, path_of, code, words",
    [
        ("big", "too-big", grpc.StatusCode.INVALID_ARGUMENT, ["lora_path", "rank"]),
        ("gone", None, grpc.StatusCode.INVALID_ARGUMENT, ["lora_path"]),
        ("", "late", grpc.StatusCode.INVALID_ARGUMENT, ["lora_name"]),
        ("x" * 300, "late", grpc.StatusCode.INVALID_ARGUMENT, ["lora_name", "--max-id-chars"]),
        ("nul", "\x00", grpc.StatusCode.INVALID_ARGUMENT, ["lora_path"]),
    ],
)
def test_a_bad_adapter_is_refused_naming_the_field(mesh, model_dir, offline, lora_name, path_of, code, words):
    _, adapters = model_dir
    path = adapters.get(path_of, path_of) if path_of else str(model_dir[0] / "no-such-adapter")
    for stub in (mesh.gateway, mesh.engines["engine"]):
        with pytest.raises(grpc.RpcError) as e:
            stub.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=path), timeout=60)
        assert e.value.code() == code, e.value.details()
        assert all(w in e.value.details() for w in words), e.value.details()
    assert model_cards(mesh).keys() == {str(model_dir[0]), "sql"}
    tokens = prompt(30)
    assert through_gateway(mesh, tokens, model="sql") == offline(tokens, "sql")  # still serving


def test_unknown_models_and_adapters_are_not_found(mesh, model_dir):
    with pytest.raises(grpc.RpcError) as e:
        through_gateway(mesh, prompt(40), model="nope")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert f"'{model_dir[0]}'" in e.value.details() and "'sql'" in e.value.details()
    params = client.sampling_params(max_tokens=2)
    request = engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt(40), sampling_params=params, lora_name="nope")
    with pytest.raises(grpc.RpcError) as e:
        list(mesh.engines["engine"].Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "loaded: sql" in e.value.details()
    for stub in (mesh.gateway, mesh.engines["engine"]):
        with pytest.raises(grpc.RpcError) as e:
            stub.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(lora_name="nope"), timeout=60)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details()
    # A huge name is refused as briefly.
    with pytest.raises(grpc.RpcError) as e:
        through_gateway(mesh, prompt(40), model="m" * 100_000)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and len(e.value.details()) < 1000
    # On the engine a name over --max-id-chars is bad input, named, as LoadLoraAdapter's.
    request.lora_name = "m" * 100_000
    with pytest.raises(grpc.RpcError) as e:
        list(mesh.engines["engine"].Generate(request, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "lora_name" in e.value.details()
    assert len(e.value.details()) < 1000


def scrape_lora_info(mesh) -> list[tuple[dict, float]]:
    """vllm:lora_requests_info's samples on the engine's /metrics: (labels, value)."""
    from prometheus_client.parser import text_string_to_metric_families

    port = mesh.services["engine"].server.telemetry.metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        if family.name == "vllm:lora_requests_info"
        for s in family.samples
    ]


def test_unload_while_in_use_is_refused_and_the_metric_shows_it(mesh, offline):
    """A long request under `sql` on the engine with metrics: while it runs, the gauge names `sql` running and an
    unload is refused there; the request ends with its right output, and the adapter can go afterwards."""
    tokens, max_tokens = prompt(50), 200
    params = client.sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = engine_pb2.EngineGenerateRequest(prompt_token_ids=tokens, sampling_params=params, lora_name="sql")
    call = mesh.engines["engine"].Generate(request, timeout=120)
    received = [t for c in next(call).outputs for t in c.token_ids]
    samples = scrape_lora_info(mesh)
    unload = common_pb2.UnloadLoraAdapterRequest(lora_name="sql")
    with pytest.raises(grpc.RpcError) as e:
        mesh.engines["engine"].UnloadLoraAdapter(unload, timeout=60)
    received += [t for m in call for c in m.outputs for t in c.token_ids]
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "sql" in e.value.details()
    assert received == offline(tokens, "sql", max_tokens)

    assert len(samples) == 1
    labels, value = samples[0]
    assert labels == {"max_lora": "2", "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
    assert abs(value - time.time()) < 60  # the time of the last update, as vLLM's
    wait_until(lambda: scrape_lora_info(mesh)[0][0]["running_lora_adapters"] == "")


def test_an_unload_one_engine_refuses_leaves_every_engine_with_the_adapter(mesh, offline):
    """`sql` runs a long request on one engine: the gateway's unload is refused there, naming that engine, and the
    other engine, which had unloaded it, has loaded it again: both list it and serve it with the same output."""
    tokens, max_tokens = prompt(55), 200
    params = client.sampling_params(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    request = engine_pb2.EngineGenerateRequest(prompt_token_ids=tokens, sampling_params=params, lora_name="sql")
    call = mesh.engines["engine"].Generate(request, timeout=120)
    received = [t for c in next(call).outputs for t in c.token_ids]
    with pytest.raises(grpc.RpcError) as e:
        mesh.gateway.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(lora_name="sql"), timeout=60)
    received += [t for m in call for c in m.outputs for t in c.token_ids]
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert mesh.services["engine"].address in e.value.details() and "sql" in e.value.details()
    assert received == offline(tokens, "sql", max_tokens)
    assert all(adapter_names(stub) == ["sql"] for stub in mesh.engines.values())
    assert "sql" in model_cards(mesh)
    assert_each_engine_serves_sql(mesh, offline, prompt(56))


def test_the_adapter_is_on_the_request_spans(mesh, receiver):
    client.collect(
        client.generate(mesh.services["gateway"].address, prompt(60), model="sql", max_tokens=2, request_id="traced")
    )

    def spans_of_trace(spans):
        root = next((s for s in spans if s.attributes.get("gen_ai.request.id") == "traced" and not s.parent_id), None)
        return [] if root is None else [s for s in spans if s.trace_id == root.trace_id]

    wanted = {("llmmesh-gateway", "text_completion sql"), ("llmmesh-engine", "llm_request")}
    receiver.wait(lambda spans: wanted <= {(s.service, s.name) for s in spans_of_trace(spans)})
    for span in spans_of_trace(receiver.spans):
        if (span.service, span.name) in wanted or span.name == "llmmesh.v1.Engine/Generate" and span.kind == 2:
            assert span.attributes.get("llmmesh.lora_name") == "sql", span


def test_serve_passes_the_lora_flags_to_its_engines(model_dir):
    _, adapters = model_dir
    args = EngineArgs(
        model="m", enable_lora=True, lora_modules=[f"a={adapters['sql']}", f"b={adapters['late']}"], max_loras=3
    )
    parsed = build_parser().parse_args(["engine", *engine_flags(args)])
    assert EngineArgs.from_cli_args(parsed) == args


def test_lora_modules_from_the_environment_split_as_the_flag(monkeypatch):
    """LLMMESH_LORA_MODULES takes the flag's list with commas or spaces between the entries."""
    for value in ("a=/x,b=/y", "a=/x b=/y", " a=/x , b=/y ", "a=/x,\tb=/y"):
        monkeypatch.setenv("LLMMESH_LORA_MODULES", value)
        parsed = build_parser().parse_args(["engine", "--enable-lora"])
        assert EngineArgs.from_cli_args(parsed).get_lora_modules() == {"a": "/x", "b": "/y"}, value
    assert build_parser().parse_args(["engine", "--lora-modules", "c=/z"]).lora_modules == ["c=/z"]  # the flag wins


def test_prefix_aware_routing_finds_an_adapters_blocks(mesh):
    """The gateway names a LoRA request's blocks as the engines do, with the digest of the adapter's weights: the
    same prompt under the same adapter goes to the engine that holds its blocks (without the digest the two engines
    would tie, and the tie goes to the other engine in turn)."""
    digests = {
        a.digest
        for stub in mesh.engines.values()
        for a in stub.ListLoraAdapters(engine_pb2.ListLoraAdaptersRequest(), timeout=10).adapters
        if a.lora_name == "sql"
    }
    assert len(digests) == 1 and len(next(iter(digests))) == 32
    address, tokens = mesh.services["gateway"].address, prompt(70, length=4 * 16 + 3)
    first = client.collect(client.generate(address, tokens, model="sql", max_tokens=1))
    assert first.complete.usage.cached_tokens == 0
    # Until the engine's KV events reach the gateway's index, the second request might go to the other engine.
    deps = next(s for s in mesh.services["gateway"].server.servicers if isinstance(s, Gateway)).deps
    lora_key = next(iter(deps.lora_adapters.values()))["sql"].digest
    hashes = deps.router.block_hashes(tokens, None, lora_key)
    wait_until(lambda: max(local for local, _ in deps.router.index.match(hashes)) == 4)
    again = client.collect(client.generate(address, tokens, model="sql", max_tokens=1))
    assert again.complete.usage.cached_tokens == 4 * 16


def test_an_engine_without_lora_refuses_clearly(model_dir):
    path, adapters = model_dir
    flags = ["--model", str(path), "--kv-cache-memory", KV, "--shutdown-timeout", "5"]
    with InProcessService("engine", flags) as engine, mesh_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        load = common_pb2.LoadLoraAdapterRequest(lora_name="sql", lora_path=adapters["sql"])
        with pytest.raises(grpc.RpcError) as e:
            stub.LoadLoraAdapter(load, timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--enable-lora" in e.value.details()
        params = client.sampling_params(max_tokens=2)
        request = engine_pb2.EngineGenerateRequest(prompt_token_ids=prompt(80), sampling_params=params, lora_name="sql")
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(request, timeout=60))
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "--enable-lora" in e.value.details()
        assert adapter_names(stub) == []
        request.lora_name = ""
        assert len([t for m in stub.Generate(request, timeout=60) for c in m.outputs for t in c.token_ids]) == 2


# ---- each adapter as a model of its own on VllmEngine (--lora-vllm-ports), for smg --------------------------------


@pytest.fixture(scope="module")
def adapter_ports_engine(model_dir):
    """An engine serving `sql` (loaded) and `late` (not yet) each on a VllmEngine port of its own; for smg, which
    reaches workers in plaintext only, the base model and `sql` also on plaintext loopback ports ("plain", "plain-sql").
    """
    from test_interop import free_port

    path, adapters = model_dir
    ports = {name: free_port() for name in ("sql", "late", "plain", "plain-sql")}
    flags = [*lora_flags(path, adapters), "--lora-vllm-ports", f"sql={ports['sql']}", f"late={ports['late']}"]
    flags += ["--vllm-plaintext-port", ports["plain"], "--lora-vllm-plaintext-ports", f"sql={ports['plain-sql']}"]
    with InProcessService("engine", flags) as engine:
        yield engine, {name: f"127.0.0.1:{port}" for name, port in ports.items()}


def vllm_generate(address: str, tokens: list[int]) -> list[int]:
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    params = vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = vllm_engine_pb2.GenerateRequest(
        request_id=f"r{random.random()}",
        tokenized=vllm_engine_pb2.TokenizedInput(input_ids=tokens),
        sampling_params=params,
    )
    with mesh_channel(address, "router") as channel:
        replies = vllm_engine_pb2_grpc.VllmEngineStub(channel).Generate(request, timeout=60)
        return [t for m in replies for t in m.complete.output_ids]


def test_an_adapter_port_serves_the_adapter_as_its_model(adapter_ports_engine, model_dir, offline):
    """VllmEngine on an adapter's port names the adapter as its model and generates with it; the engine's own port
    serves the base model. A port for an adapter not loaded answers NOT_FOUND and reports itself unhealthy until
    the adapter is loaded at run time, and again once it is unloaded."""
    from smg_grpc_proto.generated import vllm_engine_pb2, vllm_engine_pb2_grpc

    engine, ports = adapter_ports_engine
    path, adapters = model_dir
    tokens = prompt(90)
    assert offline(tokens, "sql") != offline(tokens) != offline(tokens, "late")
    assert vllm_generate(ports["sql"], tokens) == offline(tokens, "sql")
    assert vllm_generate(engine.address, tokens) == offline(tokens)
    with mesh_channel(ports["late"], "router") as channel, mesh_channel(engine.address) as main:
        vllm = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        info = vllm.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=10)
        assert info.served_model_name == "late" and info.vocab_size == COMMON["vocab_size"]
        with pytest.raises(grpc.RpcError) as e:
            vllm_generate(ports["late"], tokens)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and "'late'" in e.value.details()
        health = vllm.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10)
        assert not health.healthy and "'late' is not loaded" in health.message

        stub = engine_pb2_grpc.EngineStub(main)
        stub.LoadLoraAdapter(
            common_pb2.LoadLoraAdapterRequest(lora_name="late", lora_path=adapters["late"]), timeout=60
        )
        assert vllm.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=10).healthy
        assert vllm_generate(ports["late"], tokens) == offline(tokens, "late")
        stub.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(lora_name="late"), timeout=60)
        with pytest.raises(grpc.RpcError) as e:
            vllm_generate(ports["late"], tokens)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(
    "ports, words",
    [
        (["sql"], "NAME=PORT"),
        (["sql=0"], "NAME=PORT"),
        (["sql=70000"], "NAME=PORT"),
        (["=5000"], "NAME=PORT"),
        (["sql=5000", "sql=5001"], "each name and port once"),
        (["sql=5000", "late=5000"], "each name and port once"),
    ],
)
def test_bad_lora_vllm_ports_are_refused_naming_the_flag(ports, words):
    from services.engine_service import lora_vllm_ports

    args = build_parser().parse_args(["engine", "--enable-lora", "--lora-vllm-ports", *ports])
    with pytest.raises(ValueError, match="lora_vllm_ports") as e:
        lora_vllm_ports(args)
    assert words in str(e.value)
    args = build_parser().parse_args(["engine", "--lora-vllm-ports", "sql=5000"])
    with pytest.raises(ValueError, match="needs enable_lora"):
        lora_vllm_ports(args)
    args = build_parser().parse_args(["engine", "--enable-lora", "--lora-vllm-plaintext-ports", *ports])
    with pytest.raises(ValueError, match="lora_vllm_plaintext_ports") as e:
        lora_vllm_ports(args, "lora_vllm_plaintext_ports")
    assert words in str(e.value)


def listening(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5):
            return True
    except (urllib.error.URLError, ConnectionError):
        return False


@pytest.mark.slow
def test_smg_selects_an_adapter_by_its_model_name(adapter_ports_engine, model_dir, offline, tmp_path):
    """smg (multi-model mode) in front of the engine's plaintext loopback ports for the base model and the `sql`
    adapter: `model` set to the adapter's name gives the adapter's output, the base model's name the base model's, as
    the offline API gives them."""
    from test_interop import SmgRouter, http_json, smg_missing

    reason = smg_missing()
    if reason:
        pytest.skip(reason)
    _, ports = adapter_ports_engine
    path, _ = model_dir
    router = SmgRouter([], None, tmp_path / "smg.log", ["--enable-igw"])
    try:
        wait_until(lambda: listening(router.url), timeout=60)
        for address in (ports["plain"], ports["plain-sql"]):  # multi-model mode takes its workers over its API
            http_json(f"{router.url}/workers", {"url": f"grpc://{address}"})

        def models() -> set[str]:
            try:
                return {m["id"] for m in http_json(f"{router.url}/v1/models", timeout=5)["data"]}
            except urllib.error.HTTPError:  # 503 until a worker registers
                return set()

        wait_until(lambda: models() == {str(path), "sql"}, timeout=60)
        tokens = prompt(91)
        text = " ".join(f"<{t}>" for t in tokens)  # the test model's tokenizer: one word a token id
        for model, lora_name in ((str(path), ""), ("sql", "sql")):
            body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            reply = http_json(f"{router.url}/v1/completions", body)
            assert reply["choices"][0]["text"] == " ".join(f"<{t}>" for t in offline(tokens, lora_name)), model
    finally:
        router.stop()
