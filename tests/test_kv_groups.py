"""KV connectors, the KV store, P/D, KV events and routing on a model whose layers form two KV cache groups (Qwen2:
full attention on layer 0, a sliding window of 16 tokens on layer 1), with prompts well past the window. A second
engine loads the first one's blocks (each group's under its own fingerprint, a sliding group only its window's) and
its greedy output equals Hugging Face's; the prefix hit follows the local prefix cache's rules."""

import json

import pytest
import torch
from test_model_config import save_sliding_model

from conftest import (
    HFReference,
    InProcessService,
    assert_greedy_matches,
    assert_no_leaks,
    loading_kv_config,
    run_greedy,
)
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.kv.hashing import extend_block_hashes, get_hash_fn, root_hash
from engine.kv.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from engine.kv.prefix_hit import longest_common_hit, longest_group_hit, needed_blocks
from engine.request import Request, SamplingParams
from llmmesh.v1 import engine_pb2
from services.engine_service import kv_events_to_llmmesh
from services.local_mesh import kv_transfer_config
from services.routing import Router

BLOCK = 8
WINDOW = 16  # the sliding group needs the 2 blocks (15 tokens) before a hit's end
MAX_TOKENS = 6
FULL, SLIDING = FullAttentionSpec(), SlidingWindowSpec(WINDOW)


def test_prefix_hit_rules():
    """Full attention: the leading run. A sliding window: the rightmost run as long as its window. Together: the
    longest prefix both serve, looked up again where a shorter one moves the window back."""
    cached = [True, False, False, True, True, True, False]
    assert longest_group_hit(FULL, BLOCK, cached.__getitem__, 7) == 1
    assert longest_group_hit(SLIDING, BLOCK, cached.__getitem__, 7) == 6
    assert longest_group_hit(SLIDING, BLOCK, cached.__getitem__, 5) == 5
    assert longest_group_hit(SLIDING, BLOCK, cached.__getitem__, 4) == 1  # only a run from the start is left
    assert list(needed_blocks(SLIDING, BLOCK, 6)) == [4, 5] and list(needed_blocks(FULL, BLOCK, 3)) == [0, 1, 2]
    # The full group holds 0..4; the sliding group 3..5: they agree on 5 blocks (its window 3, 4 is there).
    held = {0: range(5), 1: range(3, 6)}
    assert longest_common_hit([FULL, SLIDING], BLOCK, lambda g, i: i in held[g], 6) == 5
    # The sliding group lacks block 3: at 5 its window (3, 4) is broken, and at 4 too; only 0 is agreed on.
    held = {0: range(5), 1: [4, 5]}
    assert longest_common_hit([FULL, SLIDING], BLOCK, lambda g, i: i in held[g], 6) == 0


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    path, hf_model = save_sliding_model(
        tmp_path_factory.mktemp("hybrid"),
        "Qwen2ForCausalLM",
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=1,
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (60, 45)]
    references = [HFReference(hf_model).greedy(p, MAX_TOKENS) for p in prompts]
    return path, prompts, references


def make_engine(path, config: str, **args) -> EngineCore:
    return EngineCore(
        EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=BLOCK, kv_transfer_config=config, **args)
    )


def assert_matches(outputs, references, label):
    for i, (ours, (tokens, logits)) in enumerate(zip(outputs, references)):
        assert_greedy_matches(ours, tokens, logits, f"{label} prompt {i}")


def settle(engine: EngineCore) -> None:
    while engine.has_unfinished_requests():
        engine.step()


@pytest.fixture
def kvstore(redis_server):
    with InProcessService("kvstore", ["--redis-url", redis_server.url]) as service:
        yield service


@pytest.fixture(params=["KVStoreConnector", "SharedStorageConnector"])
def config(request, tmp_path) -> str:
    if request.param == "KVStoreConnector":
        return loading_kv_config(request.getfixturevalue("kvstore").address)
    extra = {"shared_storage_path": str(tmp_path)}
    return json.dumps({"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": extra})


def test_a_second_engine_loads_each_groups_blocks_and_matches_hf(hybrid, config):
    path, prompts, references = hybrid
    first = make_engine(path, config)
    layouts = first.info.kv_layouts
    assert [x.kv_cache_spec for x in layouts] == [FULL, SLIDING] and [x.layer_ids for x in layouts] == [(0,), (1,)]
    assert len({x.fingerprint for x in layouts}) == 2 and layouts[0].shape[0] == layouts[1].shape[0] == 1
    assert_matches(run_greedy(first, prompts, MAX_TOKENS), references, "first engine")
    settle(first)
    assert first.get_stats().kv_connector_stats["stored_blocks"] > 0

    second = make_engine(path, config)
    assert second.info.kv_layouts == layouts  # the same model grouped alike: the same fingerprints
    assert_matches(run_greedy(second, prompts, MAX_TOKENS), references, "second engine")
    stats = second.get_stats().kv_connector_stats
    # Every full prompt block but the last token's: the full group's all of them, the sliding group's last two.
    loaded = [(n - 1) // BLOCK for n in map(len, prompts)]
    assert stats["loaded_tokens"] == sum(loaded) * BLOCK
    assert stats["loaded_bytes"] == sum(n + 2 for n in loaded) * layouts[0].block_bytes
    settle(second)
    assert_no_leaks(second)


def test_a_store_without_the_sliding_groups_first_blocks_still_serves_the_prefix(hybrid, tmp_path):
    """The sliding group's blocks before its window are never read again: a lookup looks past them."""
    path, prompts, references = hybrid
    config = json.dumps(
        {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}
    )
    first = make_engine(path, config)
    run_greedy(first, prompts[:1], MAX_TOKENS)
    sliding_dir = tmp_path / first.info.kv_layouts[1].fingerprint
    hash_fn = get_hash_fn("sha256")
    hashes = extend_block_hashes([], prompts[0], BLOCK, hash_fn, root_hash(hash_fn), None)
    num_blocks = (len(prompts[0]) - 1) // BLOCK
    for block_hash in hashes[: num_blocks - 2]:
        (sliding_dir / block_hash.hex()).unlink()
    # Its last block gone too: the hit ends where the window before it is whole, one block earlier.
    second = make_engine(path, config)
    assert_matches(run_greedy(second, prompts[:1], MAX_TOKENS), references[:1], "sliding blocks missing")
    assert second.get_stats().kv_connector_stats["loaded_tokens"] == num_blocks * BLOCK
    (sliding_dir / hashes[num_blocks - 1].hex()).unlink()
    third = make_engine(path, config)
    assert_matches(run_greedy(third, prompts[:1], MAX_TOKENS), references[:1], "window broken")
    assert third.get_stats().kv_connector_stats["loaded_tokens"] == 0  # block n-2 alone is no window
    settle(third)
    assert_no_leaks(third)


def test_prefill_and_decode_engines_hand_over_every_group(hybrid, kvstore):
    """P/D: a kv_producer computes the prompt and stores each group's blocks; the kv_consumer loads them."""
    check_prefill_and_decode(*hybrid, kvstore)


def check_prefill_and_decode(path, prompts, references, kvstore) -> None:
    """A kv_producer engine computes each prompt and stores its blocks; the kv_consumer loads them (its own
    load_policy says never: do_remote_prefill overrides it) and decodes Hugging Face's tokens."""
    producer = make_engine(path, kv_transfer_config(kvstore.address, "kv_producer"))
    consumer = make_engine(path, kv_transfer_config(kvstore.address, "kv_consumer", load_policy="never"))
    for i, prompt in enumerate(prompts):
        producer.add_request(Request(f"p{i}", prompt, SamplingParams(max_tokens=1), kv_transfer_params={}))
    settle(producer)
    tokens = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        consumer.add_request(Request(str(i), prompt, params, kv_transfer_params={"do_remote_prefill": True}))
        tokens[str(i)] = []
    while consumer.has_unfinished_requests():
        for out in consumer.step():
            tokens[out.request_id] += out.new_token_ids
    assert_matches([tokens[str(i)] for i in range(len(prompts))], references, "P/D")
    assert consumer.get_stats().kv_connector_stats["loaded_tokens"] == sum(
        (len(p) - 1) // BLOCK * BLOCK for p in prompts
    )
    assert_no_leaks(consumer)


def test_kv_events_name_the_group_and_routing_follows_the_full_group(hybrid):
    path, prompts, _ = hybrid
    engine = EngineCore(
        EngineArgs(model=str(path), kv_cache_memory="8MiB", block_size=BLOCK, enable_kv_cache_events=True)
    )
    run_greedy(engine, prompts[:1], 1)
    batch = kv_events_to_llmmesh(1, 0.0, engine.kv_cache_manager.take_events())
    stored = [e.stored for e in batch.events if e.WhichOneof("event") == "stored"]
    assert {s.group_id for s in stored} == {0, 1}

    router = Router(["a", "b"])
    info = engine_pb2.ModelInfo(block_size=BLOCK, enable_prefix_caching=True, prefix_caching_hash_algo="sha256")
    router.set_model_info(info)
    router.index.apply(1, batch)  # engine "b" holds the prompt
    hashes = router.block_hashes(prompts[0], None)
    assert router.index.match(hashes)[1] == (len(hashes), 0)
    # The sliding group lets its first blocks go: the full group still holds them, and so does the index.
    removed = engine_pb2.KvEventBatch(events=[{"removed": {"block_hashes": hashes[:3], "group_id": 1}}])
    router.index.apply(1, removed)
    assert router.index.match(hashes)[1] == (len(hashes), 0)
    assert router.route({"a", "b"}, prompts[0]).address == "b"
    router.index.apply(1, engine_pb2.KvEventBatch(events=[{"removed": {"block_hashes": hashes[:1]}}]))
    assert router.index.match(hashes)[1] == (0, 0)
