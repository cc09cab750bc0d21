"""Prefill/decode disaggregation through the kvstore (vLLM's P/D): a kv_producer engine computes each prompt and
stores its blocks, the kv_consumer engine loads them and decodes. Outputs equal one engine's, greedy and seeded,
with and without faults: a prefill engine that is gone, a store that lost blocks, a load that fails."""

import json
import random
import signal
from types import SimpleNamespace

import grpc
import pytest
import redis
from test_serve import SERVING_LINE, Serve

from conftest import InProcessService, mesh_channel
from engine.config import EngineArgs
from llmmesh.v1 import engine_pb2, engine_pb2_grpc
from random_model import save_random_smollm2_shaped
from services import client
from services.certs import redis_password
from services.cli import build_parser
from services.local_mesh import Mesh, kv_transfer_config
from services.routing import Router
from services.supervisor import disaggregated_engines
from test_models import COMMON

BLOCK = 16
MAX_TOKENS = 8
PROMPT_TOKENS = 70  # 4 full blocks; the consumer loads them and computes the last 6 tokens
FULL_BLOCK_TOKENS = PROMPT_TOKENS // BLOCK * BLOCK
PREFILL_TIMEOUT = 3  # s the gateway gives the prefill engine
SAMPLINGS = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 1234}}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-pd")
    save_random_smollm2_shaped(path, **COMMON)
    return path


@pytest.fixture(scope="module")
def single(tiny_model):
    """One engine alone, no KV store: the outputs to match."""
    flags = ["--model", str(tiny_model), "--kv-cache-memory", "16MiB", "--no-enable-prefix-caching"]
    with InProcessService("engine", flags) as engine, mesh_channel(engine.address) as channel:
        yield engine_pb2_grpc.EngineStub(channel)


@pytest.fixture(scope="module")
def mesh(tiny_model):
    args = EngineArgs(model=str(tiny_model), kv_cache_memory="16MiB", max_num_seqs=8)
    gateway_args = ["--prefill-timeout", str(PREFILL_TIMEOUT)]
    options = {"retry_interval_s": 0.5}  # not the default: every engine's connector must be given it
    with Mesh(
        args, kv_store=True, prefill_engines=1, num_engines=1, gateway_args=gateway_args, kv_connector_options=options
    ) as m:
        yield m


def prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(3, 512), k=PROMPT_TOKENS)


def alone(single, tokens: list[int], sampling: dict) -> list[int]:
    params = client.sampling_params(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    request = engine_pb2.EngineGenerateRequest(prompt_token_ids=tokens, sampling_params=params)
    return [t for msg in single.Generate(request, timeout=60) for c in msg.outputs for t in c.token_ids]


def through(mesh, tokens: list[int], sampling: dict, timeout: float = 120) -> tuple[list[int], int]:
    """Through the P/D gateway: the reply and the prompt tokens the decode engine did not compute."""
    responses = client.generate(
        mesh.address, tokens, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=timeout, **sampling
    )
    result = client.collect(responses)
    return result.token_ids[0], result.complete.usage.cached_tokens


def prefill(mesh, tokens: list[int]) -> engine_pb2.EngineGenerateResponse:
    """What the gateway asks of the prefill engine, asked directly: its last message."""
    request = engine_pb2.EngineGenerateRequest(
        prompt_token_ids=tokens,
        sampling_params=client.sampling_params(max_tokens=1),
        kv_transfer_params='{"do_remote_decode":true}',
    )
    with mesh_channel(mesh.services["prefill"].address) as channel:
        return list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))[-1]


def decode(
    mesh, tokens: list[int], sampling: dict, kv_transfer_params: str = '{"do_remote_prefill":true}'
) -> tuple[list[int], int]:
    """What the gateway asks of the decode engine after the prefill, asked directly: the reply and the prompt tokens
    it did not compute."""
    params = client.sampling_params(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    request = engine_pb2.EngineGenerateRequest(
        prompt_token_ids=tokens, sampling_params=params, kv_transfer_params=kv_transfer_params
    )
    with mesh_channel(mesh.services["engine"].address) as channel:
        messages = list(engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=60))
    return [t for msg in messages for c in msg.outputs for t in c.token_ids], messages[-1].usage.cached_tokens


def test_mesh_gives_every_engine_its_connector_options(mesh):
    """Mesh's kv_connector_options reach the --kv-transfer-config of the prefill and the decode engine, beside the
    kvstore's address and each one's kv_role."""
    for name, role in (("prefill", "kv_producer"), ("engine", "kv_consumer")):
        args = mesh.services[name].args
        config = json.loads(args[args.index("--kv-transfer-config") + 1])
        assert config["kv_role"] == role
        assert config["kv_connector_extra_config"] == {
            "kvstore_address": mesh.services["kvstore"].address,
            "retry_interval_s": 0.5,
        }


@pytest.mark.parametrize("load_policy", ["auto", "never"])
def test_do_remote_prefill_loads_whatever_the_load_policy(mesh, single, tiny_model, load_policy):
    """The request's do_remote_prefill reaches the connector: a kv_consumer loads what the prefill engine stored even
    when its own load_policy would not (never), and waits for it (WAITING_FOR_REMOTE_KVS) rather than recompute."""
    config = kv_transfer_config(mesh.services["kvstore"].address, "kv_consumer", load_policy=load_policy)
    flags = ["--model", str(tiny_model), "--kv-cache-memory", "16MiB", "--kv-transfer-config", config]
    with InProcessService("engine", flags) as consumer:
        consumer_mesh = SimpleNamespace(services={"engine": consumer})
        tokens = prompt(30)
        prefill(mesh, tokens)
        reply, loaded = decode(consumer_mesh, tokens, SAMPLINGS["greedy"])
        assert reply == alone(single, tokens, SAMPLINGS["greedy"])
        assert loaded == FULL_BLOCK_TOKENS
        if load_policy == "never":  # without the flag, the policy decides
            tokens = prompt(31)
            prefill(mesh, tokens)
            reply, loaded = decode(consumer_mesh, tokens, SAMPLINGS["greedy"], kv_transfer_params="")
            assert reply == alone(single, tokens, SAMPLINGS["greedy"])
            assert loaded == 0


def block_keys(mesh, tokens: list[int]) -> tuple[redis.Redis, list[bytes]]:
    """The kvstore's Redis and the keys of the prompt's full blocks there, in order (None where absent)."""
    with mesh_channel(mesh.services["engine"].address) as channel:
        info = engine_pb2_grpc.EngineStub(channel).GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=30)
    router = Router(["engine"])
    router.set_model_info(info)
    store = redis.Redis.from_url(mesh.redis.url, password=redis_password(mesh.tls_dir))  # its ACL user's
    return store, [next(iter(store.keys(f"kv:*:{h.hex()}")), None) for h in router.block_hashes(tokens, "")]


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
def test_outputs_equal_one_engine_and_the_decode_engine_loads_the_prompt(mesh, single, sampling):
    for seed in range(3):
        tokens = prompt(100 * list(SAMPLINGS).index(sampling) + seed)  # new to the decode engine
        reply, loaded = through(mesh, tokens, SAMPLINGS[sampling])
        assert reply == alone(single, tokens, SAMPLINGS[sampling]), (sampling, seed)
        assert loaded == FULL_BLOCK_TOKENS  # every full block came from the producer, through the store


def test_store_that_lost_blocks_costs_recomputation(mesh, single):
    """Blocks lost between the two hops: the decode engine loads those left and computes the rest."""
    tokens = prompt(7)
    assert prefill(mesh, tokens).kv_transfer_params == '{"do_remote_prefill":true,"do_remote_decode":false}'
    store, keys = block_keys(mesh, tokens)
    assert all(keys)  # stored before the producer answered
    store.delete(*keys[1:])
    reply, loaded = decode(mesh, tokens, SAMPLINGS["seeded"])
    assert reply == alone(single, tokens, SAMPLINGS["seeded"])
    assert loaded == BLOCK


def test_producer_stores_again_what_the_store_lost(mesh, single):
    """Blocks lost before the request: the producer, which holds them in its cache, writes them to the store again."""
    tokens = prompt(6)
    prefill(mesh, tokens)
    store, keys = block_keys(mesh, tokens)
    store.delete(*keys[1:])
    reply, loaded = through(mesh, tokens, SAMPLINGS["greedy"])
    assert reply == alone(single, tokens, SAMPLINGS["greedy"])
    assert loaded == FULL_BLOCK_TOKENS
    assert all(block_keys(mesh, tokens)[1])


def test_load_that_fails_costs_recomputation(mesh, single):
    tokens = prompt(8)
    prefill(mesh, tokens)  # in the store now; the producer checks they are present, not what they hold
    store, keys = block_keys(mesh, tokens)
    value = bytearray(store.get(keys[2]))
    value[-100] ^= 0xFF
    store.set(keys[2], bytes(value))
    reply, loaded = through(mesh, tokens, SAMPLINGS["seeded"])
    assert reply == alone(single, tokens, SAMPLINGS["seeded"])
    assert loaded == 2 * BLOCK  # the blocks before the corrupt one; the rest was recomputed


def test_prefill_engine_gone_costs_recomputation(mesh, single):
    mesh.services["prefill"].kill()
    try:
        for i, (name, sampling) in enumerate(SAMPLINGS.items()):
            tokens = prompt(9 + i)
            reply, loaded = through(mesh, tokens, sampling)
            assert reply == alone(single, tokens, sampling), name
            assert loaded == 0  # nothing in the store: the decode engine computed the prompt
    finally:
        mesh.restart("prefill")


def test_prefill_engine_hung_costs_its_timeout_then_recomputation(mesh, single):
    """A stopped prefill engine (SIGSTOP) holds a request no longer than --prefill-timeout; its failed health checks
    then keep the gateway off it until it answers again."""
    prefill_process = mesh.services["prefill"].popen
    prefill_process.send_signal(signal.SIGSTOP)
    try:
        for i, (name, sampling) in enumerate(SAMPLINGS.items()):
            tokens = prompt(40 + i)
            # Within a deadline far short of a hang's, though longer than the prefill timeout.
            reply, loaded = through(mesh, tokens, sampling, timeout=10 * PREFILL_TIMEOUT)
            assert reply == alone(single, tokens, sampling), name
            assert loaded == 0  # the decode engine computed the prompt
    finally:
        prefill_process.send_signal(signal.SIGCONT)
    # Back in the gateway's turn once its health check passes: the decode engine loads the prompt again.
    for attempt in range(100):
        tokens = prompt(50 + attempt)
        reply, loaded = through(mesh, tokens, SAMPLINGS["greedy"])
        if loaded:
            break
    assert loaded == FULL_BLOCK_TOKENS
    assert reply == alone(single, tokens, SAMPLINGS["greedy"])


def test_kv_transfer_params_name_the_field_at_fault(mesh):
    cases = {
        "[1]": "kv_transfer_params must be a JSON object",
        '{"do_remote_decode":1}': "kv_transfer_params.do_remote_decode must be true or false",
        '{"remote_engine_id":"x"}': "allowed: do_remote_decode, do_remote_prefill",
        '{"do_remote_prefill":true}': "do_remote_prefill needs an engine with kv_role kv_consumer or kv_both",
    }
    with mesh_channel(mesh.services["prefill"].address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        for text, message in cases.items():
            request = engine_pb2.EngineGenerateRequest(
                prompt_token_ids=[5, 6, 7],
                sampling_params=client.sampling_params(max_tokens=1),
                kv_transfer_params=text,
            )
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, text
            assert message in e.value.details(), text


def test_serve_runs_prefill_and_decode_engines(tiny_model, single):
    """`llmmesh serve --prefill-engines 1 --decode-engines 2`: a kv_producer and two kv_consumers behind the gateway,
    one kvstore between them."""
    flags = ["--port", "0", "--model", str(tiny_model), "--kv-cache-memory", "16MiB", "--no-sampler-service"]
    process = Serve([*flags, "--prefill-engines", "1", "--decode-engines", "2", "--log-level", "WARNING"])
    try:
        services = {}
        while len(services) < 8:
            name, address, _, _ = process.expect(SERVING_LINE).groups()
            services[name] = address
        assert {"prefill", "engine", "engine-2", "kvstore"} <= set(services)
        address = process.expect(r"llmmesh gateway listening on (\S+)").group(1)
        tokens = prompt(20)
        result = client.collect(
            client.generate(address, tokens, max_tokens=MAX_TOKENS, ignore_eos=True, timeout=120, **SAMPLINGS["seeded"])
        )
        assert result.token_ids[0] == alone(single, tokens, SAMPLINGS["seeded"])
        assert result.complete.usage.cached_tokens == FULL_BLOCK_TOKENS
    finally:
        process.stop()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--decode-engines", "2"], "--decode-engines needs --prefill-engines"),
        (["--prefill-engines", "1", "--engines", "2"], "give the decode engines' count as --decode-engines"),
        (["--prefill-engines", "1", "--no-kv-store"], "through the KV store"),
        (["--prefill-engines", "-1"], "--prefill-engines must be from 0 to 64"),
    ],
)
def test_serve_refuses_inconsistent_engine_counts(flags, message):
    with pytest.raises(ValueError, match=message):
        disaggregated_engines(build_parser().parse_args(["serve", *flags]))
