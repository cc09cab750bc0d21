"""Expert parallelism (--enable-expert-parallel) over two ranks, each a process, over gloo on loopback: each rank
holds half of every mixture-of-experts layer's experts, whole, and the greedy output in float32 is the one rank's,
token for token, on tiny random Mixtral, Qwen3-MoE and DeepSeek-V2 models; and where it cannot apply it is refused
before any rank starts."""

import families
import pytest
import torch
import transformers
from test_deepseek import deepseek_v2
from test_mixtral import config as mixtral
from test_qwen_moe import qwen3_moe, rewrite_checkpoint, stack_experts

from conftest import assert_no_leaks, run_greedy
from engine.attention.selector import get_attn_backend
from engine.distributed import parallel_state
from engine.models.files import load_config
from engine.models.fused_moe import FusedMoE
from engine.models.loader import load_weights
from engine.models.registry import ModelRegistry
from test_models import COMMON

FAMILIES = {"mixtral": mixtral, "qwen3-moe": qwen3_moe, "deepseek-v2": deepseek_v2}


def experts_of(model) -> list[FusedMoE]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ep2_greedy_output_equals_one_ranks_and_each_rank_holds_its_experts(tmp_path, family):
    """The ranks sum their own experts' contributions where one rank sums all of them, so the logits differ by float
    rounding only and the greedy tokens are identical; rank 0 (in this process) holds the first half of the experts
    at their full width."""
    config = FAMILIES[family]()
    path, hf_model = families.save_family_model(tmp_path, config)
    batch = families.prompts(config)
    one = families.make_engine(path, max_num_batched_tokens=16)
    try:
        expected = run_greedy(one, batch, families.MAX_TOKENS)
        whole = experts_of(one.executor.driver_worker.model)
    finally:
        one.shutdown()
    engine = families.make_engine(path, tensor_parallel_size=2, enable_expert_parallel=True, max_num_batched_tokens=16)
    try:
        assert run_greedy(engine, batch, families.MAX_TOKENS) == expected
        assert_no_leaks(engine)
        rank0 = experts_of(engine.executor.driver_worker.model)
    finally:
        engine.shutdown()
    families.assert_matches_hf(hf_model, batch, expected, "one rank")
    assert len(rank0) == len(whole) > 0
    for ours, all_experts in zip(rank0, whole):
        half = all_experts.num_experts // 2
        assert (ours.num_local_experts, ours.expert_start) == (half, 0)
        assert ours.w13_weight.shape == (half, *all_experts.w13_weight.shape[1:])
        assert ours.w2_weight.shape == (half, *all_experts.w2_weight.shape[1:])
        assert torch.equal(ours.w13_weight, all_experts.w13_weight[:half])
        assert torch.equal(ours.w2_weight, all_experts.w2_weight[:half])


def build_rank(model_dir, monkeypatch, rank: int, size: int, expert_parallel: bool):
    """The model as rank `rank` of `size` builds and loads it (its layers read the rank when built)."""
    monkeypatch.setattr(parallel_state, "_tp_rank", rank)
    monkeypatch.setattr(parallel_state, "_tp_size", size)
    monkeypatch.setattr(parallel_state, "_enable_expert_parallel", expert_parallel)
    arch = load_config(model_dir)
    model = ModelRegistry.resolve_model_cls(arch.architecture)(arch, get_attn_backend("torch", 8, "cpu"))
    model.load_weights(load_weights(model_dir))
    return model


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_each_rank_loads_only_its_experts_and_the_ranks_make_the_whole(tmp_path, monkeypatch, stacked):
    """Per-expert checkpoint tensors of another rank's experts are skipped, stacked ones cut to this rank's; with
    tensor parallelism alone every rank holds every expert, half as wide."""
    config = qwen3_moe()
    path, _ = families.save_family_model(tmp_path, config)
    if stacked:
        path = rewrite_checkpoint(path, change_tensors=lambda t: stack_experts(t, config.num_experts))
    whole = experts_of(build_rank(path, monkeypatch, 0, 1, False))
    ep = [experts_of(build_rank(path, monkeypatch, r, 2, True)) for r in range(2)]
    tp = experts_of(build_rank(path, monkeypatch, 1, 2, False))
    width, hidden = config.moe_intermediate_size, config.hidden_size
    for layer, full in enumerate(whole):
        assert tuple(full.w13_weight.shape) == (8, 2 * width, hidden)
        ranks = [experts[layer] for experts in ep]
        assert [(r.expert_start, r.num_local_experts) for r in ranks] == [(0, 4), (4, 4)]
        assert all(tuple(r.w13_weight.shape) == (4, 2 * width, hidden) for r in ranks)
        assert all(tuple(r.w2_weight.shape) == (4, hidden, width) for r in ranks)
        assert torch.equal(torch.cat([r.w13_weight for r in ranks]), full.w13_weight)
        assert torch.equal(torch.cat([r.w2_weight for r in ranks]), full.w2_weight)
        assert tuple(tp[layer].w13_weight.shape) == (8, width, hidden)


def test_experts_that_do_not_split_over_the_ranks_are_refused(tmp_path):
    path, _ = families.save_family_model(tmp_path, mixtral(num_local_experts=5))
    with pytest.raises(ValueError, match=r"--enable-expert-parallel needs the model's 5 experts to divide by "):
        families.make_engine(path, tensor_parallel_size=2, enable_expert_parallel=True)


def test_a_model_without_experts_is_refused(tmp_path):
    path, _ = families.save_family_model(tmp_path, transformers.LlamaConfig(**COMMON))
    with pytest.raises(ValueError, match="--enable-expert-parallel splits mixture-of-experts layers, and Llama"):
        families.make_engine(path, tensor_parallel_size=2, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        families.make_engine(path, enable_expert_parallel=True)
