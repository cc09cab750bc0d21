"""Tensor parallelism: two ranks, each a process, over gloo on loopback, on a tiny random Llama whose heads (4),
KV heads (2) and MLP width divide by 2; with a KV connector, a real redis-server behind a real kvstore service, or a
directory."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
import redis
import torch

from conftest import InProcessService, assert_no_leaks, loading_kv_config, mesh_channel, run_greedy
from engine.attention.selector import get_attn_backend
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.distributed import parallel_state
from engine.executor.messages import decode, encode, scheduler_output_from_wire, scheduler_output_to_wire
from engine.executor.multiproc import KVOutputAggregator, free_port_pair
from engine.executor.uniproc import ExecutorDeadError
from engine.kv.connector.base import KVConnectorOutput
from engine.lora.request import LoRARequest
from engine.models.files import load_config
from engine.models.linear import RowParallelLinear
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_weights
from engine.request import Request, SamplingParams
from engine.sched.output import SchedulerOutput
from llmmesh.v1 import engine_pb2, engine_pb2_grpc
from random_model import save_random_smollm2_shaped
from services import client
from test_models import COMMON

BLOCK = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-tp")
    save_random_smollm2_shaped(path, **COMMON)
    return path


def make_engine(model_dir, tensor_parallel_size: int, **kwargs) -> EngineCore:
    kwargs = {"dtype": "float32", "kv_cache_memory": "16MiB", **kwargs}
    return EngineCore(EngineArgs(model=str(model_dir), tensor_parallel_size=tensor_parallel_size, **kwargs))


def prompts() -> list[list[int]]:
    """Prompts of under one block, several blocks, and one long enough to be prefilled in two chunks."""
    return [random.Random(seed).choices(range(3, COMMON["vocab_size"]), k=k) for seed, k in enumerate((5, 37, 90))]


def run(engine: EngineCore) -> dict[str, tuple[list[int], list[torch.Tensor], torch.Tensor]]:
    """Greedy requests with logprobs and prompt logprobs: each one's tokens, per-token logprobs, prompt logprobs."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    for i, prompt in enumerate(prompts()):
        engine.add_request(Request(str(i), prompt, params))
    results = {str(i): ([], [], None) for i in range(len(prompts()))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens, logprobs, _ = results[out.request_id]
            tokens += out.new_token_ids
            if out.new_logprobs is not None:
                logprobs.append(out.new_logprobs.logprobs)
            if out.new_prompt_logprobs is not None:
                results[out.request_id] = (tokens, logprobs, out.new_prompt_logprobs.logprobs)
    assert_no_leaks(engine)
    return results


def test_tp2_greedy_output_and_logprobs_equal_tp1_in_float32(tiny_model):
    """The ranks' partial sums add in another order than one device's matmul, so logits differ by float rounding
    only; the greedy tokens must be identical (this model's logits are far from ties)."""
    outputs = {}
    for size in (1, 2):
        # A small token budget: the longest prompt is prefilled in two chunks beside the others' decodes.
        engine = make_engine(tiny_model, size, max_num_batched_tokens=64)
        try:
            outputs[size] = run(engine)
        finally:
            engine.shutdown()
    for request_id, (tokens, logprobs, prompt_logprobs) in outputs[1].items():
        tp_tokens, tp_logprobs, tp_prompt_logprobs = outputs[2][request_id]
        assert tp_tokens == tokens and len(tokens) == 12
        torch.testing.assert_close(torch.cat(tp_logprobs), torch.cat(logprobs), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(tp_prompt_logprobs, prompt_logprobs, atol=1e-4, rtol=1e-4)


def greedy_with_top2(engine: EngineCore) -> list[list[tuple[int, float]]]:
    """Per prompt, per token: the greedy token and the gap between its logprob and the runner-up's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    for i, prompt in enumerate(prompts()):
        engine.add_request(Request(str(i), prompt, params))
    steps = {str(i): [] for i in range(len(prompts()))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.new_token_ids:
                top = out.new_logprobs.logprobs[0]  # the sampled token's, then the top 2
                steps[out.request_id].append((out.new_token_ids[0], (top[1] - top[2]).item()))
    return [steps[str(i)] for i in range(len(prompts()))]


def test_int8_weights_shard_and_greedy_output_follows_tp1(tiny_model, tmp_path):
    """Each rank takes its part of the cached codes (a row-parallel shard keeps each row's one scale), and bfloat16
    sums in another order; so greedy tokens equal TP=1's up to a near-tie."""
    outputs = {}
    for size in (1, 2):
        engine = make_engine(tiny_model, size, quantization="int8", dtype="bfloat16", download_dir=str(tmp_path))
        try:
            outputs[size] = greedy_with_top2(engine)
        finally:
            engine.shutdown()
    for ours, reference in zip(outputs[2], outputs[1]):
        assert len(ours) == len(reference) == 8
        for (token, _), (expected, gap) in zip(ours, reference):
            if token != expected:  # the rest of the sequence follows another context
                assert gap < 0.25, f"TP=2 chose {token}, TP=1 {expected} by a logprob margin of {gap:.3f}"
                break


def test_tensors_cross_to_the_ranks_exactly_and_aligned():
    """Decoded tensors live in torch's aligned memory: the int8 kernel's vector loads crashed on a Python buffer."""
    hidden = torch.randn(3, 7, dtype=torch.bfloat16)
    message = {"op": "logits", "hidden_states": hidden, "rows": [0, 2], "none": None, "empty": torch.empty(0, 4)}
    decoded = decode(encode(message), torch.device("cpu"))
    assert torch.equal(decoded["hidden_states"], hidden) and decoded["hidden_states"].data_ptr() % 64 == 0
    assert decoded["rows"] == [0, 2] and decoded["none"] is None and decoded["empty"].shape == (0, 4)
    with pytest.raises(TypeError, match="cannot send a object to the other ranks"):
        encode({"op": "forward", "plan": object()})
    data = bytearray(encode({"t": torch.zeros(4)}))
    data[data.index(b"[4]") + 1] = ord("9")  # the header claims 9 elements, the body holds 4
    with pytest.raises(ValueError, match=r"tensor of shape \[9\] is larger than the bytes received"):
        decode(bytes(data), torch.device("cpu"))


def test_scheduler_output_crosses_as_new_then_cached_requests():
    """A request's prompt crosses once; later steps carry only its new tokens. The grammar bitmask, drafts and
    adapter cross too, and the rank rebuilds the same SchedulerOutput over its own request states."""
    lora = LoRARequest("sql", 1, "/adapters/sql")
    a = Request("a", [1, 2, 3, 4], SamplingParams(prompt_logprobs=2), lora_request=lora)
    b = Request("b", [5, 6], SamplingParams())
    sent, states = {}, {}

    def cross(so: SchedulerOutput) -> tuple[dict, SchedulerOutput]:
        wire = decode(encode({"so": scheduler_output_to_wire(so, sent)}), torch.device("cpu"))["so"]
        return wire, scheduler_output_from_wire(wire, states)

    bitmask = torch.tensor([[-1, 5]], dtype=torch.int32)
    first = SchedulerOutput([a, b], {"a": 4, "b": 2}, 6, {"a": [[7]], "b": [[3]]}, grammar_bitmask=bitmask)
    first.structured_output_request_ids = {"b": 0}
    wire, rebuilt = cross(first)
    assert [r["req_id"] for r in wire["scheduled_new_reqs"]] == ["a", "b"] and not wire["scheduled_cached_reqs"]
    assert [r.all_token_ids for r in rebuilt.scheduled_requests] == [[1, 2, 3, 4], [5, 6]]
    assert rebuilt.scheduled_requests[0].lora_request == lora
    assert rebuilt.scheduled_requests[0].sampling_params.prompt_logprobs == 2
    assert torch.equal(rebuilt.grammar_bitmask, bitmask) and rebuilt.structured_output_request_ids == {"b": 0}
    assert rebuilt.block_ids == {"a": [[7]], "b": [[3]]} and rebuilt.num_scheduled_tokens == {"a": 4, "b": 2}

    for request, token in ((a, 9), (b, 8)):  # both sampled a token; a also gets two drafts to verify
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids(token)
    second = SchedulerOutput([b, a], {"a": 3, "b": 1}, 4, {"a": [7], "b": [3]}, preempted_req_ids={"c"})
    second.scheduled_spec_decode_tokens = {"a": [11, 12]}
    wire, rebuilt = cross(second)
    assert not wire["scheduled_new_reqs"] and wire["scheduled_cached_reqs"] == [["b", [8], 2], ["a", [9], 4]]
    assert [(r.request_id, r.all_token_ids, r.num_computed_tokens) for r in rebuilt.scheduled_requests] == [
        ("b", [5, 6, 8], 2),
        ("a", [1, 2, 3, 4, 9], 4),
    ]
    assert rebuilt.scheduled_requests[1].num_output_tokens == 1  # its prompt logprobs are not asked again
    assert rebuilt.scheduled_spec_decode_tokens == {"a": [11, 12]} and rebuilt.preempted_req_ids == {"c"}

    third = SchedulerOutput([], {}, 0, {}, finished_req_ids={"a"})
    assert cross(third)[1].is_empty and set(states) == set(sent) == {"b"}  # a's state is gone on both sides


def test_a_rank_started_by_hand_as_on_another_host_joins_through_master_addr(tiny_model, monkeypatch):
    """Rank 1 started first, by hand, as on a second host: it waits for rank 0 at MASTER_ADDR:MASTER_PORT + 1."""
    port = free_port_pair()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LLMMESH_TP_TOKEN": "shared-secret"}
    for name, value in {**env, "LLMMESH_TP_LOCAL_RANKS": ""}.items():
        monkeypatch.setenv(name, value)
    rank1 = subprocess.Popen([sys.executable, "-m", "engine.executor.multiproc", "--rank", "1"], env=os.environ.copy())
    try:
        engine = make_engine(tiny_model, 2)
        try:
            assert _rank_processes() == [rank1.pid]  # rank 0 started none itself
            by_hand = run_greedy(engine, prompts(), 8)
        finally:
            engine.shutdown()
        assert rank1.wait(timeout=30) == 0  # told to stop, it stops
    finally:
        rank1.kill()
    monkeypatch.delenv("LLMMESH_TP_LOCAL_RANKS")
    engine = make_engine(tiny_model, 1)
    try:
        assert by_hand == run_greedy(engine, prompts(), 8)
    finally:
        engine.shutdown()


def build_rank(model_dir, monkeypatch, rank: int, size: int) -> LlamaForCausalLM:
    """The model as rank `rank` of `size` builds and loads it (its layers read the rank when built)."""
    monkeypatch.setattr(parallel_state, "_tp_rank", rank)
    monkeypatch.setattr(parallel_state, "_tp_size", size)
    model = LlamaForCausalLM(load_config(model_dir), get_attn_backend("torch", BLOCK, "cpu"))
    model.load_weights(load_weights(model_dir))
    return model


def test_each_rank_keeps_its_shard_and_the_shards_make_the_whole(tiny_model, monkeypatch):
    full = build_rank(tiny_model, monkeypatch, 0, 1)
    ranks = [build_rank(tiny_model, monkeypatch, r, 2) for r in range(2)]
    head_dim = COMMON["hidden_size"] // COMMON["num_attention_heads"]
    q, kv = COMMON["num_attention_heads"] * head_dim, COMMON["num_key_value_heads"] * head_dim
    attn = [m.layers[0].self_attn for m in (full, *ranks)]
    assert [(a.num_heads, a.num_kv_heads) for a in attn] == [(4, 2), (2, 1), (2, 1)]
    assert tuple(attn[1].qkv_proj.weight.shape) == ((q + 2 * kv) // 2, COMMON["hidden_size"])
    assert tuple(attn[1].o_proj.weight.shape) == (COMMON["hidden_size"], q // 2)
    vocab = COMMON["vocab_size"]
    assert tuple(ranks[1].embed_tokens.weight.shape) == (vocab // 2, COMMON["hidden_size"])

    def parts(tensor, sizes):  # a fused weight's parts, each split in two: the rank-ordered halves of each
        return [half for part in tensor.split(sizes) for half in part.chunk(2)]

    for i in range(COMMON["num_hidden_layers"]):
        whole, shards = full.layers[i], [m.layers[i] for m in ranks]
        qkv = parts(whole.self_attn.qkv_proj.weight, [q, kv, kv])
        assert torch.equal(shards[0].self_attn.qkv_proj.weight, torch.cat(qkv[0::2]))
        assert torch.equal(shards[1].self_attn.qkv_proj.weight, torch.cat(qkv[1::2]))
        gate_up = parts(whole.mlp.gate_up_proj.weight, [COMMON["intermediate_size"]] * 2)
        assert torch.equal(shards[1].mlp.gate_up_proj.weight, torch.cat(gate_up[1::2]))
        for name in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: the input columns
            joined = torch.cat([s.get_submodule(name).weight for s in shards], dim=1)
            assert torch.equal(joined, whole.get_submodule(name).weight)
        assert torch.equal(shards[1].input_layernorm.weight, whole.input_layernorm.weight)  # replicated
    assert torch.equal(torch.cat([m.embed_tokens.weight for m in ranks]), full.embed_tokens.weight)


def test_quantized_groups_that_would_be_cut_are_refused(monkeypatch):
    monkeypatch.setattr(parallel_state, "_tp_size", 2)
    layer = RowParallelLinear(64, 8)
    scales = torch.ones(8, 3)  # three quantization groups along the input: two ranks would cut one
    with pytest.raises(ValueError, match=r"scales of shape \(8, 3\) does not split into --tensor-parallel-size 2"):
        layer.shard(scales, "layers.0.mlp.down_proj.scales")
    assert tuple(layer.shard(torch.ones(8, 4), "scales").shape) == (8, 2)  # whole groups split


@pytest.mark.parametrize(
    "size, message",
    [
        (3, r"attention heads \(num_attention_heads\) \(4\) does not divide by --tensor-parallel-size 3"),
        (4, r"KV heads \(num_key_value_heads\) \(2\) does not divide by --tensor-parallel-size 4"),
    ],
)
def test_sizes_that_do_not_divide_are_refused_before_any_rank_starts(tiny_model, size, message):
    before = _rank_processes()
    with pytest.raises(ValueError, match=message):
        make_engine(tiny_model, size)
    assert _rank_processes() == before


def test_bad_tensor_parallel_flags_are_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be in \[1, 64\], got 0"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be in \[1, 64\], got 100000"):
        EngineArgs(tensor_parallel_size=100000)
    draft = '{"method": "draft_model", "model": "draft", "num_speculative_tokens": 2}'
    with pytest.raises(ValueError, match="method draft_model is not supported with tensor_parallel_size > 1"):
        EngineArgs(tensor_parallel_size=2, speculative_config=draft)


def _rank_processes() -> list[int]:
    """Pids of this process's tensor-parallel ranks."""
    found = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "engine.executor.multiproc"], capture_output=True)
    return sorted(int(p) for p in found.stdout.split())


def test_a_rank_killed_mid_step_ends_the_engine_with_an_error_naming_it(tiny_model):
    engine = make_engine(tiny_model, 2)
    try:
        (rank1,) = _rank_processes()
        engine.add_request(Request("0", [5, 6, 7], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)))
        engine.step()
        os.kill(rank1, signal.SIGKILL)
        began = time.monotonic()
        with pytest.raises(ExecutorDeadError, match=r"tensor-parallel rank 1 is gone \(pid \d+ exited with code -9\)"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - began < 20  # a closed connection fails the collective at once, no timeout
    finally:
        engine.shutdown()


def test_a_rank_killed_fails_the_engine_service_streams_and_ends_it(tiny_model):
    flags = ["--model", tiny_model, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--tensor-parallel-size", 2]
    with InProcessService("engine", flags) as service, mesh_channel(service.address) as channel:
        (rank1,) = _rank_processes()
        params = client.sampling_params(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = engine_pb2_grpc.EngineStub(channel).Generate(
            engine_pb2.EngineGenerateRequest(prompt_token_ids=[5, 6, 7], sampling_params=params), timeout=120
        )
        next(stream)  # running
        os.kill(rank1, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as failure:
            for _ in stream:
                pass
        assert failure.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "tensor-parallel rank 1 is gone" in failure.value.details()
        assert service.wait_exit() == 1  # a dead engine ends, to be restarted


def test_a_rank_killed_while_idle_ends_the_engine_service(tiny_model):
    flags = ["--model", tiny_model, "--dtype", "float32", "--kv-cache-memory", "16MiB", "--tensor-parallel-size", 2]
    with InProcessService("engine", flags) as service:
        (rank1,) = _rank_processes()
        os.kill(rank1, signal.SIGKILL)
        assert service.wait_exit() == 1


def test_collective_rpc_runs_on_every_rank_and_an_error_leaves_them_in_step(tiny_model):
    engine = make_engine(tiny_model, 2)
    try:
        whole = engine.worker.get_cache_block_size_bytes() * 2  # rank 0's is half the heads
        assert engine.executor.collective_rpc("get_cache_block_size_bytes") == [whole // 2, whole // 2]
        # Every rank fails (no adapters without --enable-lora); each answers, so the next step finds them in step.
        with pytest.raises(AttributeError):
            engine.executor.collective_rpc("add_lora", (LoRARequest("sql", 1, "/adapters/sql"),))
        tp2 = run_greedy(engine, prompts(), 4)
    finally:
        engine.shutdown()
    engine = make_engine(tiny_model, 1)
    try:
        assert tp2 == run_greedy(engine, prompts(), 4)
    finally:
        engine.shutdown()


def test_a_start_that_fails_after_the_ranks_started_ends_them(tiny_model):
    before = _rank_processes()
    with pytest.raises(ValueError, match="holds no block"):
        make_engine(tiny_model, 2, kv_cache_memory="1KiB")  # refused once every rank has sized its cache
    assert _rank_processes() == before


def test_ranks_share_the_cores(tiny_model, monkeypatch):
    """Each of the two ranks on this host runs on half its cores (at least one), unless $OMP_NUM_THREADS says."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = torch.get_num_threads()
    engine = make_engine(tiny_model, 2)
    try:
        assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        (rank1,) = _rank_processes()
        environ = dict(e.split("=", 1) for e in open(f"/proc/{rank1}/environ").read().split("\0") if "=" in e)
        assert environ["LOCAL_WORLD_SIZE"] == "2"
    finally:
        engine.shutdown()
    assert torch.get_num_threads() == threads


def test_a_transfer_ends_once_every_rank_reported_it_with_what_all_of_them_moved():
    aggregator = KVOutputAggregator(2)
    rank0 = KVConnectorOutput(finished_recving={"a": 32, "b": 48}, finished_sending={1: True, 2: True})
    rank1 = KVConnectorOutput(finished_recving={"a": 16}, finished_sending={1: False})
    done = aggregator.aggregate([rank0, rank1])
    # a: rank 1 brought one block of two, so one is recomputed on both; store 1 failed on rank 1
    assert done.finished_recving == {"a": 16} and done.finished_sending == {1: False}
    later = aggregator.aggregate([KVConnectorOutput(), KVConnectorOutput({"b": 48}, {2: True})])
    assert later.finished_recving == {"b": 48} and later.finished_sending == {2: True}
    assert not aggregator.recving and not aggregator.sending


def settle(engine: EngineCore) -> None:
    """Step until every KV transfer has ended."""
    while engine.has_unfinished_requests():
        engine.step()


@dataclass
class ShardStore:
    """A connector's --kv-transfer-config, the (fingerprint, block hash) of every shard stored, and a way to drop
    every shard stored under one fingerprint."""

    config: str
    shards: Callable[[], list[tuple[str, str]]]
    drop: Callable[[str], None]


@pytest.fixture(params=["KVStoreConnector", "SharedStorageConnector"])
def shard_store(request, tmp_path):
    """The kvstore on a fresh redis-server, or a fresh directory."""
    if request.param == "SharedStorageConnector":
        extra = {"shared_storage_path": str(tmp_path)}
        config = {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": extra}

        def files(pattern: str) -> list:  # whole block files (one being written is a dot file)
            return [f for f in tmp_path.glob(pattern) if not f.name.startswith(".")]

        yield ShardStore(
            json.dumps(config),
            lambda: [(f.parent.name, f.name) for f in files("*/*")],
            lambda fingerprint: [f.unlink() for f in files(f"{fingerprint}/*")],
        )
        return
    redis_url = request.getfixturevalue("redis_server").url
    store = redis.Redis.from_url(redis_url)
    with InProcessService("kvstore", ["--redis-url", redis_url]) as kvstore:
        yield ShardStore(
            loading_kv_config(kvstore.address),
            lambda: [tuple(k.decode().split(":")[1:]) for k in store.keys("kv:*")],
            lambda fingerprint: store.delete(*store.keys(f"kv:{fingerprint}:*")),
        )


def test_tp2_stores_each_ranks_shard_and_reloads_it_equal_to_tp1(tiny_model, shard_store):
    """Every rank stores its heads of each block under its own fingerprint; after the local prefix cache is reset
    the blocks come back from the store, and greedy output equals TP=1's. With rank 1's shards gone, the blocks no
    longer count as stored (rank 0's alone are not a block): they are recomputed on both ranks, with the same output."""
    engine = make_engine(tiny_model, 1)
    try:
        expected = run_greedy(engine, prompts(), 8)
    finally:
        engine.shutdown()
    full_blocks = sum((len(p) - 1) // BLOCK for p in prompts())  # the block with the last prompt token always runs
    engine = make_engine(tiny_model, 2, kv_transfer_config=shard_store.config)
    try:
        assert run_greedy(engine, prompts(), 8) == expected
        settle(engine)
        rank0, rank1 = engine.worker.kv_layouts[0].shard_fingerprints
        shards = shard_store.shards()
        on_rank0 = {block for fingerprint, block in shards if fingerprint == rank0}
        on_rank1 = {block for fingerprint, block in shards if fingerprint == rank1}
        assert len(shards) == len(on_rank0) + len(on_rank1) and on_rank0 == on_rank1 and len(on_rank0) >= full_blocks

        assert engine.reset_prefix_cache()
        assert run_greedy(engine, prompts(), 8) == expected
        stats = engine.get_stats().kv_connector_stats
        assert stats["loaded_tokens"] == full_blocks * BLOCK and stats["load_failed_tokens"] == 0

        settle(engine)
        assert engine.reset_prefix_cache()
        shard_store.drop(rank1)
        assert run_greedy(engine, prompts(), 8) == expected
        after = engine.get_stats().kv_connector_stats
        assert after["lookups"] > stats["lookups"] and after["lookup_hit_tokens"] == stats["lookup_hit_tokens"]
        assert after["loaded_tokens"] == full_blocks * BLOCK and after["load_failed_tokens"] == 0
        settle(engine)
        assert_no_leaks(engine)
    finally:
        engine.shutdown()
