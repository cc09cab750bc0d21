"""The start-up check of tensor parallelism's shapes (engine/models/linear.py check_tensor_parallel_size) for
mixture-of-experts models: without expert parallelism the experts' width must split over the ranks; with
--enable-expert-parallel each rank keeps whole experts, so it need not, while the dense MLPs' widths (a dense
layer's, the shared experts') still must. Two ranks; no process is started."""

import families
import pytest
from test_deepseek import deepseek_v2
from test_expert_parallel import build_rank, experts_of
from test_mixtral import config as mixtral
from test_qwen_moe import qwen2_moe, qwen3_moe

from engine.models.config import ModelArchConfig
from engine.models.linear import check_tensor_parallel_size

ARCHITECTURES = {
    "MixtralConfig": "MixtralForCausalLM",
    "Qwen2MoeConfig": "Qwen2MoeForCausalLM",
    "Qwen3MoeConfig": "Qwen3MoeForCausalLM",
    "DeepseekV2Config": "DeepseekV2ForCausalLM",
}


def arch(config, **changes) -> ModelArchConfig:
    architectures = [ARCHITECTURES[type(config).__name__]]
    return ModelArchConfig.from_hf_config({**config.to_dict(), "architectures": architectures, **changes})


# Configs whose routed experts are 25 wide, which does not divide by 2; their dense widths do.
EXPERTS_WIDTH = {
    "mixtral": lambda: arch(mixtral(), intermediate_size=25),
    "qwen3-moe": lambda: arch(qwen3_moe(), moe_intermediate_size=25),
    "deepseek-v2": lambda: arch(deepseek_v2(), moe_intermediate_size=25, n_shared_experts=2),  # shared: 50 wide
}


@pytest.mark.parametrize("family", sorted(EXPERTS_WIDTH))
def test_the_experts_width_must_divide_without_expert_parallel_only(family):
    config = EXPERTS_WIDTH[family]()
    with pytest.raises(ValueError, match=r"the experts' width \((moe_)?intermediate_size; .*\(25\) does not divide"):
        check_tensor_parallel_size(config, 2)
    check_tensor_parallel_size(config, 2, enable_expert_parallel=True)


# Configs with a dense MLP 25 wide beside their experts, and how the refusal names it.
DENSE_WIDTH = {
    "qwen3-moe-dense-layer": (
        lambda: arch(qwen3_moe("bias-mlp-only-unnormalised"), intermediate_size=25),
        "the model's MLP width (intermediate_size) (25)",
    ),
    "qwen2-moe-shared-expert": (
        lambda: arch(qwen2_moe(), shared_expert_intermediate_size=25),
        "the shared expert's width (shared_expert_intermediate_size) (25)",
    ),
    "deepseek-v2-shared-experts": (
        lambda: arch(deepseek_v2(), moe_intermediate_size=25, n_shared_experts=1),
        "the shared experts' width (moe_intermediate_size x n_shared_experts) (25)",
    ),
}


@pytest.mark.parametrize("case", sorted(DENSE_WIDTH))
def test_dense_mlp_widths_must_divide_under_expert_parallel_too(case):
    make, shown = DENSE_WIDTH[case]
    config = make()
    for ep in (False, True):
        with pytest.raises(ValueError, match="does not divide by --tensor-parallel-size 2") as refused:
            check_tensor_parallel_size(config, 2, enable_expert_parallel=ep)
        assert shown in str(refused.value)
    check_tensor_parallel_size(config, 1, enable_expert_parallel=True)


def test_a_rank_builds_whole_experts_whose_width_does_not_divide(tmp_path, monkeypatch):
    """Mixtral with experts 25 wide over two ranks: refused by the executor before any rank starts without expert
    parallelism; with it, rank 0 builds and loads its half of the experts at their full width."""
    config = mixtral(intermediate_size=25)
    path, _ = families.save_family_model(tmp_path, config)
    with pytest.raises(ValueError, match="the experts' width"):
        families.make_engine(path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="the experts' width"):
        build_rank(path, monkeypatch, 0, 2, False)
    experts = experts_of(build_rank(path, monkeypatch, 0, 2, True))
    assert experts and all(tuple(e.w2_weight.shape) == (4, config.hidden_size, 25) for e in experts)
