"""The hybrid KV cache: layers grouped by what they keep, a sliding-window group's blocks freed as its window moves
(the null block in their place), prefix hits per group and the hit every group agrees on; and end to end, greedy
output equal to Hugging Face's past the window while a sliding layer's memory grows with its window only."""

import json
import random

import pytest
import torch
from test_cuda_graphs import tiny_config
from test_model_config import save_sliding_model

from conftest import HFReference, assert_greedy_matches, assert_no_leaks, run_greedy
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.kv.kv_cache_spec import (
    FullAttentionSpec,
    SlidingWindowSpec,
    group_size,
    kv_cache_groups,
    layer_to_group,
    layer_to_tensor,
)
from engine.kv.manager import KVCacheManager
from engine.models.config import ModelArchConfig
from engine.request import Request, SamplingParams
from engine.sched.output import ModelRunnerOutput
from engine.sched.scheduler import Scheduler

BLOCK = 4
FULL, SLIDE = "full_attention", "sliding_attention"


def arch_config(layer_types: list[str], window: int = 8) -> ModelArchConfig:
    sliding = SLIDE in layer_types
    return tiny_config(
        num_hidden_layers=len(layer_types),
        sliding_window=window if sliding else None,
        layer_types=tuple(layer_types) if sliding else (),
    )


def request(request_id, tokens, max_tokens=1000):
    return Request(str(request_id), list(tokens), SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def held(manager) -> int:
    return sum(1 for b in manager.block_pool.blocks if b.ref_cnt > 0)


def advance(manager, req, num_tokens):
    """One step of num_tokens new tokens for req: allocate, then count them computed."""
    assert manager.allocate_slots(req, num_tokens) is not None
    req.num_computed_tokens += num_tokens


# ---- groups ---------------------------------------------------------------------------------------------------


def test_layers_are_grouped_by_spec_in_equal_groups():
    # Gemma 3's pattern, five sliding layers to one global, over 12 layers: groups of 2, the full one first.
    gemma3 = arch_config(([SLIDE] * 5 + [FULL]) * 2)
    groups = kv_cache_groups(gemma3)
    assert [g.spec for g in groups] == [FullAttentionSpec()] + [SlidingWindowSpec(8)] * 5
    assert [g.layer_ids for g in groups] == [(5, 11), (0, 1), (2, 3), (4, 6), (7, 8), (9, 10)]
    assert group_size(groups) == 2
    assert layer_to_group(groups)[:6] == [1, 1, 2, 2, 3, 0]
    assert layer_to_tensor(groups)[:6] == [0, 1, 0, 1, 0, 0]
    # One kind of layer: one group of every layer, as before there were groups.
    for layer_types in ([FULL] * 4, [SLIDE] * 4):
        (group,) = kv_cache_groups(arch_config(layer_types))
        assert group.layer_ids == (0, 1, 2, 3) and layer_to_tensor([group]) == [0, 1, 2, 3]
    # Qwen2 with max_window_layers=1 of 2: a full group and a sliding group of one layer each.
    assert [g.layer_ids for g in kv_cache_groups(arch_config([FULL, SLIDE]))] == [(0,), (1,)]


# ---- the manager ------------------------------------------------------------------------------------------------


def test_sliding_window_frees_blocks_as_the_window_moves():
    """A window of 8 tokens in blocks of 4: before each step the blocks wholly before position
    num_computed - 8 + 1 go back to the pool and the null block takes their place in the block table."""
    manager = KVCacheManager(20, BLOCK, kv_cache_specs=[SlidingWindowSpec(8)])
    null = manager.block_pool.null_block
    assert null.block_id == 0 and manager.num_blocks == 19
    req = request("r", range(12))
    advance(manager, req, 12)  # tokens 0..11: three blocks
    assert held(manager) == 3
    advance(manager, req, 1)  # the next query (position 12) sees 5..12: block 0 (0..3) is out
    (ids,) = manager.get_block_ids("r")
    assert ids[0] == 0 and 0 not in ids[1:] and held(manager) == 3
    for _ in range(40):
        req.append_output_token_ids(7)
        advance(manager, req, 1)
        assert held(manager) <= 4  # the window's blocks and the new token's, whatever the context
    (ids,) = manager.get_block_ids("r")
    assert len(ids) == 14 and ids[:11] == [0] * 11
    manager.free(req)
    assert held(manager) == 0 and manager.get_num_free_blocks() == 19 and null.ref_cnt == 0


@pytest.mark.parametrize("window", [8, 16, 32])
def test_memory_grows_with_the_window_not_the_context(window):
    peaks = []
    for context in (64, 200):
        manager = KVCacheManager(100, BLOCK, kv_cache_specs=[FullAttentionSpec(), SlidingWindowSpec(window)])
        req = request("r", range(context))
        peak = 0
        for _ in range(context):
            advance(manager, req, 1)
            full, sliding = manager.get_block_ids("r")
            peak = max(peak, sum(1 for b in sliding if b != 0))
            assert len(full) == len(sliding) and 0 not in full
        assert len(full) == context // BLOCK  # the full group keeps the whole context
        peaks.append(peak)
        manager.free(req)
    assert peaks[0] == peaks[1] == window // BLOCK + 1


def test_prefix_hits_per_group_and_the_hit_every_group_agrees_on():
    specs = [FullAttentionSpec(), SlidingWindowSpec(8)]
    manager = KVCacheManager(40, BLOCK, kv_cache_specs=specs)
    null = manager.block_pool.null_block
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks
    a = request("a", prompt)
    advance(manager, a, 30)
    manager.free(a)

    # Every block cached: the full group hits all 7, the sliding one only the 2 covering the 7 tokens the next
    # query sees before it (a hit is capped so the last prompt token runs: 28 of 30).
    (full, sliding), hit = manager.get_computed_blocks(request("b", prompt))
    assert hit == 28 and len(full) == len(sliding) == 7 and null not in full
    assert sliding[:5] == [null] * 5 and null not in sliding[5:]
    # The sliding group lost its last block: its hit ends a block earlier, and the full group agrees.
    manager.block_pool.evict_blocks([sliding[6]])
    (full, sliding), hit = manager.get_computed_blocks(request("c", prompt))
    assert hit == 24 and len(full) == len(sliding) == 6 and sliding[:4] == [null] * 4
    # The full group lost block 3: the hit is 12 tokens, and the sliding group looks again within them.
    manager.block_pool.evict_blocks([full[3]])
    (full, sliding), hit = manager.get_computed_blocks(request("d", prompt))
    assert hit == 12 and len(full) == 3 and sliding[0] is null and null not in sliding[1:]
    # A hit is held by the request that takes it, in both groups; the null block by no one.
    d = request("d", prompt)
    assert manager.allocate_slots(d, 18, hit, [full, sliding]) is not None
    d.num_computed_tokens = 12
    assert all(b.ref_cnt == 1 for b in full + sliding[1:]) and null.ref_cnt == 0
    manager.free(d)
    assert held(manager) == 0 and manager.get_num_free_blocks() == manager.num_blocks


def test_allocation_needs_every_groups_blocks_and_changes_nothing_when_short():
    manager = KVCacheManager(6, BLOCK, kv_cache_specs=[FullAttentionSpec(), SlidingWindowSpec(8)])
    assert manager.get_num_free_blocks() == 5  # 6 less the null block
    big = request("big", range(12))
    assert manager.allocate_slots(big, 12) is None  # 3 blocks in each group: 6 > 5
    assert "big" not in manager.req_to_blocks and manager.get_num_free_blocks() == 5
    assert [len(blocks) for blocks in manager.allocate_slots(big, 8)] == [2, 2]
    assert manager.get_num_free_blocks() == 1


def test_the_null_block_is_never_handed_out_and_nothing_leaks():
    """A random workload with preemptions on a hybrid pool: block 0 is never a request's own block, every block
    held is referenced, and at the end every block is free."""
    rng = random.Random(0)
    manager = KVCacheManager(60, BLOCK, kv_cache_specs=[FullAttentionSpec(), SlidingWindowSpec(6)])
    scheduler = Scheduler(manager, 24, 8, max_model_len=10_000)
    for i in range(30):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        scheduler.add_request(request(i, prompt, max_tokens=rng.randrange(1, 30)))
    pool = manager.block_pool
    while scheduler.has_unfinished_requests():
        so = scheduler.schedule()
        for request_id in so.block_ids:
            full, sliding = so.block_ids[request_id]
            assert 0 not in full and 0 not in sliding[len(sliding) - 2 :]
        scheduler.update_from_output(so, ModelRunnerOutput([[7]] * len(so.scheduled_requests)))
        assert sum(1 for b in pool.blocks if b.ref_cnt > 0) + pool.get_num_free_blocks() == pool.num_blocks
        assert pool.null_block.ref_cnt == 0 and pool.null_block not in pool.free_block_queue.get_all_free_blocks()
    assert scheduler.num_preemptions > 0  # the pool was short: preemption freed every group's blocks
    assert not manager.req_to_blocks and manager.get_num_free_blocks() == manager.num_blocks


def test_kv_events_name_the_group():
    manager = KVCacheManager(
        20, BLOCK, enable_kv_cache_events=True, kv_cache_specs=[FullAttentionSpec(), SlidingWindowSpec(8)]
    )
    req = request("r", range(8))
    advance(manager, req, 8)
    stored = manager.take_events()
    assert [e.group_id for e in stored] == [0, 1] and stored[0].block_hashes == stored[1].block_hashes
    snapshot = manager.snapshot_events(100)
    assert [getattr(e, "group_id", None) for e in snapshot] == [None, 0, 1]


# ---- end to end -------------------------------------------------------------------------------------------------


def block_bytes(num_layers: int) -> int:
    """K and V of a block of num_layers layers of the tiny models (2 KV heads of 16, float32)."""
    return 2 * num_layers * BLOCK * 2 * 16 * 4


# Mistral's one group holds a request's window only, Qwen2's full group all of its context.
POOL_BLOCKS = {"MistralForCausalLM": 14, "Qwen2ForCausalLM": 40}
HYBRID = {
    "MistralForCausalLM": dict(sliding_window=16),
    # Layer 0 full, layer 1 in a window: two groups of one layer.
    "Qwen2ForCausalLM": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
}


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("arch", sorted(HYBRID))
def test_greedy_matches_hugging_face_past_the_window_with_preemption(tmp_path, arch, async_scheduling):
    """Prompts and outputs well past the window, chunked prefill, prefix hits and preemption (a pool too small for
    three requests of up to 105 tokens at once), in blocks of 4; with async scheduling, blocks allocated and inputs
    prepared while the step before samples."""
    path, hf_model = save_sliding_model(tmp_path, arch, **HYBRID[arch])
    engine = EngineCore(
        EngineArgs(
            model=str(path),
            kv_cache_memory=str(POOL_BLOCKS[arch] * block_bytes(2 if arch == "MistralForCausalLM" else 1)),
            block_size=BLOCK,
            attention_backend="torch",
            max_num_batched_tokens=8,
            async_scheduling=async_scheduling,
        )
    )
    manager = engine.kv_cache_manager
    assert manager.num_kv_cache_groups == (2 if arch == "Qwen2ForCausalLM" else 1)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (40, 9)]
    prompts.append(prompts[0][:36] + prompts[1])  # a prefix-cache hit past the window
    outputs = run_greedy(engine, prompts, 60)
    assert engine.scheduler.num_preemptions > 0
    assert manager.prefix_cache_stats.hits == 36  # the third prompt hit the first one's prefix
    assert (engine.worker.model_runner.num_prepared_ahead > 0) == async_scheduling
    for prompt, ours in zip(prompts, outputs):
        ref_tokens, ref_logits = HFReference(hf_model).greedy(prompt, 60)
        assert_greedy_matches(ours, ref_tokens, ref_logits, f"{arch} past its window")
    assert_no_leaks(engine)


def test_two_sliding_groups_keep_their_own_blocks(tmp_path):
    """Qwen2 of three layers, the last two in a window: three groups of one layer, each sliding group with its own
    block table over the one pool; the output is the model's past the window, under preemption."""
    extra = dict(HYBRID["Qwen2ForCausalLM"], num_hidden_layers=3)
    path, hf_model = save_sliding_model(tmp_path, "Qwen2ForCausalLM", **extra)
    engine = EngineCore(
        EngineArgs(
            model=str(path), kv_cache_memory=str(60 * block_bytes(1)), block_size=BLOCK, max_num_batched_tokens=8
        )
    )
    assert engine.kv_cache_manager.num_kv_cache_groups == 3
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (33, 21, 45)]
    for prompt, ours in zip(prompts, run_greedy(engine, prompts, 50)):
        ref_tokens, ref_logits = HFReference(hf_model).greedy(prompt, 50)
        assert_greedy_matches(ours, ref_tokens, ref_logits, "Qwen2 with two sliding groups")
    assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


def test_the_same_kv_cache_memory_holds_more_tokens_with_sliding_layers(tmp_path):
    """Qwen2 with one full and one sliding layer needs one layer's bytes a block, not two: twice the blocks. And
    with every layer in a window (Mistral), a request's context may exceed all the pool's tokens."""
    full_path, _ = save_sliding_model(tmp_path / "full", "Qwen2ForCausalLM", use_sliding_window=False)
    full = EngineCore(EngineArgs(model=str(full_path), kv_cache_memory="256KiB", block_size=BLOCK))
    hybrid_path, _ = save_sliding_model(tmp_path / "hybrid", "Qwen2ForCausalLM", **HYBRID["Qwen2ForCausalLM"])
    hybrid = EngineCore(EngineArgs(model=str(hybrid_path), kv_cache_memory="256KiB", block_size=BLOCK))
    assert full.num_blocks == 128 and hybrid.num_blocks == 2 * full.num_blocks
    # The hybrid model's two layers, one in each group, use the one K/V tensor pair of 256 blocks.
    caches = hybrid.executor.driver_worker.kv_caches
    assert caches[0] is caches[1] and caches[0][0].shape[1] == 256

    path, hf_model = save_sliding_model(tmp_path / "mistral", "MistralForCausalLM", **HYBRID["MistralForCausalLM"])
    engine = EngineCore(
        EngineArgs(
            model=str(path), kv_cache_memory=str(16 * block_bytes(2)), block_size=BLOCK, max_num_batched_tokens=8
        )
    )
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    (ours,) = run_greedy(engine, [prompt], 90)
    assert len(prompt) + len(ours) > engine.num_blocks * BLOCK  # 120 tokens of context, 64 tokens of pool
    ref_tokens, ref_logits = HFReference(hf_model).greedy(prompt, 90)
    assert_greedy_matches(ours, ref_tokens, ref_logits, "Mistral past its pool")
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", sorted(HYBRID))
def test_a_draft_model_shares_the_first_groups_blocks(tmp_path, arch):
    """The target as its own draft: its KV lives in group 0's blocks (Qwen2's full group, Mistral's one window
    group, which keeps all a draft of the same window needs); every draft is kept and the output is the model's."""
    path, hf_model = save_sliding_model(tmp_path, arch, **HYBRID[arch])
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    engine = EngineCore(
        EngineArgs(model=str(path), kv_cache_memory="1MiB", block_size=BLOCK, speculative_config=json.dumps(spec))
    )
    prompt = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    (ours,) = run_greedy(engine, [prompt], 40)
    ref_tokens, ref_logits = HFReference(hf_model).greedy(prompt, 40)
    assert_greedy_matches(ours, ref_tokens, ref_logits, f"{arch} drafting for itself")
    stats = engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert_no_leaks(engine)


def test_a_draft_that_needs_more_than_a_window_group_keeps_is_refused(tmp_path):
    path, _ = save_sliding_model(tmp_path, "MistralForCausalLM", **HYBRID["MistralForCausalLM"])
    draft, _ = save_sliding_model(tmp_path / "draft", "Qwen2ForCausalLM", use_sliding_window=False)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config.model: every layer of the target model attends in a"):
        EngineCore(
            EngineArgs(model=str(path), kv_cache_memory="1MiB", block_size=BLOCK, speculative_config=json.dumps(spec))
        )
