"""Tenants through the mesh: API keys mapped to tenants by a keys file, and what one tenant cannot learn of another.

A tiny random model served in-process on loopback (one engine with KV events, the text services, a gateway with
prefix-aware routing and a keys file of two tenants). The cross-tenant oracle (whether another tenant sent a
prompt) is checked on everything that could carry it: `cached_tokens`, the engine's prefix-cache hit counters, and
the gateway's routing index; never on timing. LoRA adapters are per tenant, loaded only from under --lora-root,
and no refusal or listing names a path.
"""

import contextlib
import hashlib
import json
import os
import random

import grpc
import pytest
from test_lora_services import save_random_adapter

from conftest import InProcessService, mesh_channel, wait_until
from llmmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc, tokenizer_pb2
from random_model import save_random_smollm2_shaped
from services import client
from services.cli import build_parser
from services.tenants import Tenants, tenant_salt
from test_models import COMMON

KEYS = {"alpha": "alpha-secret-key", "beta": "beta-secret-key"}
BLOCK = 16


def keys_entry(tenant: str, **limits) -> dict:
    return {"sha256": hashlib.sha256(KEYS[tenant].encode()).hexdigest(), "tenant": tenant, **limits}


def auth(tenant: str):
    return [("authorization", f"Bearer {KEYS[tenant]}")]


def prompt(seed: int, length: int = 4 * BLOCK + 3) -> list[int]:
    return random.Random(seed).choices(range(3, COMMON["vocab_size"]), k=length)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("tenants")
    model = save_random_smollm2_shaped(root / "base", **COMMON)
    lora_root = root / "adapters"
    save_random_adapter(model, lora_root / "alpha" / "mine", rank=4, seed=1)
    save_random_adapter(model, lora_root / "beta" / "theirs", rank=4, seed=2)
    save_random_adapter(model, root / "outside", rank=4, seed=3)  # readable by the server, not under the root
    os.symlink(root / "outside", lora_root / "alpha" / "escape")
    keys_file = root / "keys.json"
    keys_file.write_text(json.dumps({"keys": [keys_entry("alpha"), keys_entry("beta")]}))
    return root, lora_root, keys_file


@pytest.fixture(scope="module")
def mesh(files):
    root, lora_root, keys_file = files
    model = ["--model", str(root / "base"), "--shutdown-timeout", "5"]
    engine_flags = [
        *model, "--kv-cache-memory", "16MiB", "--enable-kv-cache-events", "--enable-lora", "--max-lora-rank", "8",
        "--allow-runtime-lora-updating", "--lora-root", str(lora_root),
    ]  # fmt: skip
    with small_mesh(model, engine_flags, ["--api-keys-file", str(keys_file), "--routing", "prefix-aware"]) as services:
        yield services


@contextlib.contextmanager
def small_mesh(model: list[str], engine_flags: list[str], gateway_flags: list[str]):
    """An engine, the text services and a gateway, in this process: the services by name."""
    services = {}
    try:
        services["engine"] = InProcessService("engine", engine_flags)
        for name in ("tokenizer", "detokenizer"):
            services[name] = InProcessService(name, model)
        backends = [f for name, s in services.items() for f in (f"--{name}", s.address)]
        services["gateway"] = InProcessService("gateway", [*backends, *gateway_flags, "--shutdown-timeout", "5"])
        yield services
    finally:
        for service in reversed(services.values()):
            service.stop()


@pytest.fixture(scope="module")
def gateway(mesh):
    with mesh_channel(mesh["gateway"].address) as channel:
        yield gateway_pb2_grpc.GatewayStub(channel)


def generate(mesh, tenant: str, tokens, model: str = "", cache_salt: str = "") -> client.GenerateResult:
    request = gateway_pb2.GenerateRequest(
        model=model, stream=True, cache_salt=cache_salt, sampling_params=client.sampling_params(max_tokens=2)
    )
    request.token_ids.ids.extend(tokens)
    with mesh_channel(mesh["gateway"].address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        return client.collect(stub.Generate(request, metadata=auth(tenant), timeout=60))


def prefix_cache_hits(mesh) -> int:
    engine = mesh["engine"].server.servicers[0].engine
    return engine.stats.prefix_cache_hits


def routing_match(mesh, tokens, tenant: str, cache_salt: str = "") -> int:
    """The leading blocks of the prompt the gateway's routing index holds, as that tenant's request names them."""
    gateway = mesh["gateway"].server.servicers[0]
    salt = tenant_salt(gateway.tenants.authenticate(auth(tenant)), cache_salt)
    router = gateway.deps.router
    return max(local for local, _ in router.index.match(router.block_hashes(tokens, salt)))


# ---- the keys file ---------------------------------------------------------------------------------


def test_keys_file_json_and_toml(tmp_path):
    entry = keys_entry("alpha", requests_per_second=2, tokens_per_minute=600)
    (tmp_path / "k.json").write_text(json.dumps({"keys": [entry]}))
    toml = "\n".join(["[[keys]]", *(f"{k} = {json.dumps(v)}" for k, v in entry.items())])
    (tmp_path / "k.toml").write_text(toml)
    for name in ("k.json", "k.toml"):
        tenants = Tenants.from_file(str(tmp_path / name))
        tenant = tenants.authenticate(auth("alpha"))
        assert (tenant.name, tenant.requests_per_second, tenant.tokens_per_minute) == ("alpha", 2, 600)
        for bad in ([], [("authorization", "Bearer beta-secret-key")], [("authorization", KEYS["alpha"])]):
            with pytest.raises(Exception) as e:
                tenants.authenticate(bad)
            assert e.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "keys, words",
    [
        ([{"sha256": KEYS["alpha"], "tenant": "alpha"}], "keys[0].sha256"),
        ([{**keys_entry("alpha"), "tenant": "a/b"}], "keys[0].tenant"),
        ([keys_entry("alpha", requests_per_second=0)], "keys[0].requests_per_second"),
        ([keys_entry("alpha", tokens_per_minute="many")], "keys[0].tokens_per_minute"),
        ([{**keys_entry("alpha"), "burst": 3}], "keys[0]: unknown field"),
        ([keys_entry("alpha"), keys_entry("alpha")], "keys[1].sha256: the same key"),
        ([keys_entry("alpha", tokens_per_minute=5), {**keys_entry("beta"), "tenant": "alpha"}], "keys[1]: tenant"),
        ([], "non-empty list 'keys'"),
    ],
)
def test_a_bad_keys_file_is_refused_naming_the_field(tmp_path, keys, words):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": keys}))
    with pytest.raises(ValueError) as e:
        Tenants.from_file(str(path))
    assert words in str(e.value)


def test_a_key_on_the_command_line_is_refused(monkeypatch):
    monkeypatch.delenv("LLMMESH_API_KEY", raising=False)
    for argv in (
        ["gateway", "--engine", "e:1", "--tokenizer", "t:1", "--detokenizer", "d:1", "--api-key", "s3cret"],
        ["generate", "hi", "--api-key", "s3cret"],
    ):
        args = build_parser().parse_args(argv)
        with pytest.raises(ValueError) as e:
            args.func(args)
        assert "api_key" in str(e.value) and "LLMMESH_API_KEY" in str(e.value) and "s3cret" not in str(e.value)


# ---- no oracle across tenants -------------------------------------------------------------------------


def test_unknown_keys_are_unauthenticated(mesh, gateway):
    for metadata in (None, [("authorization", "Bearer nope")]):
        with pytest.raises(grpc.RpcError) as e:
            gateway.ListModels(gateway_pb2.ListModelsRequest(), metadata=metadata, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            gateway.Tokenize(tokenizer_pb2.TokenizeRequest(text="hi"), metadata=metadata, timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_another_tenants_prompt_is_not_seen_in_cached_tokens_hits_or_routing(mesh):
    secret = prompt(1)
    full_blocks = len(secret) // BLOCK
    # Beta's baseline: a prompt no one sent is not cached.
    assert generate(mesh, "beta", prompt(2)).complete.usage.cached_tokens == 0

    # Alpha sends the prompt twice: within a tenant the prefix cache shares (the oracle would be there to see).
    assert generate(mesh, "alpha", secret).complete.usage.cached_tokens == 0
    hits = prefix_cache_hits(mesh)
    assert generate(mesh, "alpha", secret).complete.usage.cached_tokens == full_blocks * BLOCK
    assert prefix_cache_hits(mesh) == hits + full_blocks * BLOCK
    wait_until(lambda: routing_match(mesh, secret, "alpha") == full_blocks)

    # Beta sends it, with no salt, and with any salt: no cached tokens, no hit counted, no routing index entry.
    for salt in ("", "guess"):
        hits = prefix_cache_hits(mesh)
        assert routing_match(mesh, secret, "beta", salt) == 0
        assert generate(mesh, "beta", secret, cache_salt=salt).complete.usage.cached_tokens == 0
        assert prefix_cache_hits(mesh) == hits

    # A client's own salt only narrows sharing within its tenant.
    assert generate(mesh, "alpha", secret, cache_salt="team-2").complete.usage.cached_tokens == 0
    assert generate(mesh, "alpha", secret, cache_salt="team-2").complete.usage.cached_tokens == full_blocks * BLOCK


# ---- LoRA adapters per tenant, under --lora-root -------------------------------------------------------


def models(gateway, tenant: str) -> dict[str, gateway_pb2.ModelCard]:
    cards = gateway.ListModels(gateway_pb2.ListModelsRequest(), metadata=auth(tenant), timeout=10).models
    return {card.id: card for card in cards}


def load(gateway, tenant: str, name: str, path: str):
    request = common_pb2.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
    return gateway.LoadLoraAdapter(request, metadata=auth(tenant), timeout=60)


def test_adapters_are_per_tenant_and_paths_are_never_shown(mesh, gateway, files):
    root = str(files[1])
    load(gateway, "alpha", "mine", "mine")
    wait_until(lambda: "mine" in models(gateway, "alpha"))
    alpha = models(gateway, "alpha")
    assert (alpha["mine"].root, alpha["mine"].parent) == ("mine", str(files[0] / "base"))  # the adapter's name
    assert "mine" not in models(gateway, "beta")
    assert len(generate(mesh, "alpha", prompt(5), model="mine").token_ids[0]) == 2

    # Beta can neither use, nor learn of, nor unload alpha's adapter; nor load one from alpha's directory.
    with pytest.raises(grpc.RpcError) as e:
        generate(mesh, "beta", prompt(5), model="mine")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "alpha" not in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        gateway.UnloadLoraAdapter(
            common_pb2.UnloadLoraAdapterRequest(lora_name="mine"), metadata=auth("beta"), timeout=60
        )
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and "alpha" not in e.value.details()
    assert "mine" in models(gateway, "alpha")
    with pytest.raises(grpc.RpcError) as e:
        load(gateway, "beta", "stolen", "mine")  # beta's directory has no "mine"
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and root not in e.value.details()

    # Both may use one name: each its own adapter.
    load(gateway, "beta", "mine", "theirs")
    wait_until(lambda: "mine" in models(gateway, "beta"))
    gateway.UnloadLoraAdapter(common_pb2.UnloadLoraAdapterRequest(lora_name="mine"), metadata=auth("beta"), timeout=60)
    wait_until(lambda: "mine" not in models(gateway, "beta"))
    assert "mine" in models(gateway, "alpha")


@pytest.mark.parametrize("path", ["../beta/theirs", "/etc", "escape", "mine/../../beta/theirs", ""])
def test_adapter_paths_that_escape_are_refused(gateway, files, path):
    with pytest.raises(grpc.RpcError) as e:
        load(gateway, "alpha", "x", path)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "lora_path" in e.value.details() and str(files[0]) not in e.value.details()
    assert "x" not in models(gateway, "alpha")


def test_the_engine_judges_the_resolved_path_and_says_the_same_of_any_refusal(mesh, files):
    """Straight to the engine (no tenants there): a symlink out of the root, a path outside it and one that does
    not exist are refused alike, naming no path."""
    root, lora_root, _ = files
    from llmmesh.v1 import engine_pb2_grpc

    with mesh_channel(mesh["engine"].address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        details = set()
        for path in (lora_root / "alpha" / "escape", root / "outside", lora_root / "nothing", "../outside"):
            with pytest.raises(grpc.RpcError) as e:
                stub.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(lora_name="x", lora_path=str(path)), timeout=60)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            details.add(e.value.details())
        assert len(details) == 1 and "--lora-root" in details.pop()


def test_the_weights_file_is_sized_against_the_rank_before_it_is_read(gateway, files):
    """An adapter whose config claims a lower rank than its weights: refused from the file's size alone."""
    _, lora_root, _ = files
    liar = lora_root / "alpha" / "liar"
    liar.mkdir()
    source = lora_root / "alpha" / "mine"
    config = json.loads((source / "adapter_config.json").read_text())
    (liar / "adapter_config.json").write_text(json.dumps({**config, "r": 1, "lora_alpha": 2}))
    (liar / "adapter_model.safetensors").write_bytes((source / "adapter_model.safetensors").read_bytes())
    with pytest.raises(grpc.RpcError) as e:
        load(gateway, "alpha", "liar", "liar")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "adapter_model.safetensors is" in e.value.details() and "rank 1" in e.value.details()
    assert str(lora_root) not in e.value.details()


def test_runtime_loading_is_off_without_the_flag(files):
    root, lora_root, _ = files
    flags = ["--model", str(root / "base"), "--kv-cache-memory", "16MiB", "--enable-lora", "--shutdown-timeout", "5"]
    with InProcessService("engine", flags) as engine, mesh_channel(engine.address) as channel:
        from llmmesh.v1 import engine_pb2_grpc

        stub = engine_pb2_grpc.EngineStub(channel)
        path = str(lora_root / "alpha" / "mine")
        with pytest.raises(grpc.RpcError) as e:
            stub.LoadLoraAdapter(common_pb2.LoadLoraAdapterRequest(lora_name="x", lora_path=path), timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--allow-runtime-lora-updating" in e.value.details()
    args = build_parser().parse_args(["engine", "--enable-lora", "--allow-runtime-lora-updating"])
    with pytest.raises(ValueError) as e:
        args.func(args)
    assert "lora_root" in str(e.value)
