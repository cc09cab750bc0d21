"""The mixture-of-experts layer (engine/models/fused_moe.py) against a plain loop over tokens and their experts, in
float64: routing (top-k, renormalised or not, ties), the grouped computation (every expert, a few, one), its
tensor-parallel split, and loading per-expert and stacked checkpoint tensors into the stacked weights; and the C++
CPU kernel (kernels/cpu/moe.cpp) against the torch fused_experts in float32 and bfloat16."""

import pytest
import torch
import torch.nn.functional as F

from engine.distributed import parallel_state
from engine.models.fused_moe import FusedMoE, expert_weight_loader, fused_experts, fused_topk

E, H, N = 8, 16, 12  # experts, hidden size, intermediate size


def reference_moe(x, w1, w3, w2, router_logits, top_k, renormalize):
    """Token by token, chosen expert by chosen expert: softmax over the experts (in float32, as transformers routes),
    top-k, weights (renormalised), sum of weight * down(silu(gate(x)) * up(x))."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(router_logits[t].float(), dim=-1)
        weights, experts = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, experts.tolist()):
            out[t] += weight * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
    return out


def random_experts(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    w1, w3 = (torch.randn(E, N, H, generator=gen, dtype=dtype) for _ in range(2))
    w2 = torch.randn(E, H, N, generator=gen, dtype=dtype)
    return w1, w3, w2


def make_moe(w1, w3, w2, top_k, renormalize, per_expert=True) -> FusedMoE:
    moe = FusedMoE(E, top_k, H, N, renormalize).to(w1.dtype)
    if per_expert:
        for e in range(E):
            for shard, w in (("w1", w1), ("w3", w3), ("w2", w2)):
                moe.weight_loader(w[e], e, shard)
    else:
        moe.stacked_weight_loader(torch.cat([w1, w3], dim=1), "gate_up_proj")
        moe.stacked_weight_loader(w2, "down_proj")
    return moe


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_fused_moe_matches_a_per_token_loop(top_k, renormalize):
    w1, w3, w2 = random_experts()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(37, H, generator=gen, dtype=torch.float64)
    logits = torch.randn(37, E, generator=gen, dtype=torch.float64)
    ours = make_moe(w1, w3, w2, top_k, renormalize)(x, logits)
    torch.testing.assert_close(ours, reference_moe(x, w1, w3, w2, logits, top_k, renormalize))


def test_tokens_routed_to_few_experts_leave_the_others_unread():
    """Every token picks among experts 2 and 5: the other experts' weights (NaN here) are never multiplied."""
    w1, w3, w2 = random_experts()
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, H, generator=gen, dtype=torch.float64)
    logits = torch.full((9, E), -30.0, dtype=torch.float64)
    logits[:, [2, 5]] = torch.randn(9, 2, generator=gen, dtype=torch.float64)
    expected = reference_moe(x, w1, w3, w2, logits, 2, True)
    unused = [e for e in range(E) if e not in (2, 5)]
    for w in (w1, w3, w2):
        w[unused] = float("nan")
    ours = make_moe(w1, w3, w2, 2, True)(x, logits)
    torch.testing.assert_close(ours, expected)
    # A single token and its one expert.
    one = reference_moe(x[:1], w1, w3, w2, logits[:1], 1, True)
    assert one.isfinite().all()
    torch.testing.assert_close(make_moe(w1, w3, w2, 1, True)(x[:1], logits[:1]), one)


def test_tied_router_logits_weigh_the_tied_experts_equally():
    """Two experts tied at the top with top_k 2: each gets half (renormalised), whatever order topk gives them;
    all experts tied without renormalisation: each chosen one weighs 1 / E."""
    w1, w3, w2 = random_experts()
    x = torch.randn(4, H, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    logits = torch.zeros(4, E, dtype=torch.float64)
    logits[:, 3] = logits[:, 6] = 2.0
    expert = [w2[e] @ (F.silu(w1[e] @ x.T) * (w3[e] @ x.T)) for e in range(E)]
    torch.testing.assert_close(make_moe(w1, w3, w2, 2, True)(x, logits), (0.5 * (expert[3] + expert[6])).T)
    weights, ids = fused_topk(torch.zeros(4, E), 2, renormalize=False)
    assert torch.equal(weights, torch.full((4, 2), 1.0 / E)) and (ids[:, 0] != ids[:, 1]).all()


def test_the_stacked_checkpoint_form_loads_as_the_per_expert_one():
    w1, w3, w2 = random_experts()
    per_expert, stacked = make_moe(w1, w3, w2, 2, True), make_moe(w1, w3, w2, 2, True, per_expert=False)
    assert torch.equal(per_expert.w13_weight, stacked.w13_weight)
    assert torch.equal(per_expert.w2_weight, stacked.w2_weight)
    assert torch.equal(per_expert.w13_weight[:, :N], w1) and torch.equal(per_expert.w13_weight[:, N:], w3)


@pytest.mark.parametrize("per_expert", [True, False])
def test_tensor_parallel_ranks_hold_a_slice_of_every_expert_and_their_sum_is_the_whole(monkeypatch, per_expert):
    w1, w3, w2 = random_experts()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(21, H, generator=gen, dtype=torch.float64)
    logits = torch.randn(21, E, generator=gen, dtype=torch.float64)
    monkeypatch.setattr(parallel_state, "_tp_size", 2)
    partial = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_tp_rank", rank)
        moe = make_moe(w1, w3, w2, 2, True, per_expert)
        assert moe.w13_weight.shape == (E, N, H) and moe.w2_weight.shape == (E, H, N // 2)
        rows = slice(rank * N // 2, (rank + 1) * N // 2)
        assert torch.equal(moe.w13_weight, torch.cat([w1[:, rows], w3[:, rows]], dim=1))
        # Each rank's output before the all-reduce.
        partial.append(fused_experts(x, moe.w13_weight, moe.w2_weight, *fused_topk(logits, 2, True)))
    torch.testing.assert_close(partial[0] + partial[1], reference_moe(x, w1, w3, w2, logits, 2, True))


def test_an_expert_width_that_does_not_split_over_the_ranks_is_refused(monkeypatch):
    monkeypatch.setattr(parallel_state, "_tp_size", 5)
    with pytest.raises(ValueError, match="intermediate size"):
        FusedMoE(E, 2, H, N, True)


def test_quantized_experts_with_biases_are_refused_by_name():
    with pytest.raises(ValueError, match="--quantization int8 is not implemented for experts with biases"):
        FusedMoE(E, 2, H, N, True, quantization="int8", has_bias=True)


def test_the_loader_reports_a_layer_complete_only_once_every_expert_arrived():
    w1, w3, w2 = random_experts(dtype=torch.float32)
    model = torch.nn.Module()
    model.experts = FusedMoE(E, 2, H, N, True)
    load = expert_weight_loader(model, {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
    assert load("norm.weight", torch.ones(H)) is None  # not an expert tensor
    done = []
    for e in range(E):
        for proj, w in (("gate_proj", w1), ("up_proj", w3), ("down_proj", w2)):
            done += load(f"experts.{e}.{proj}.weight", w[e])
            assert ("experts.w13_weight" in done) == (e == E - 1 and proj != "gate_proj")
    assert sorted(done) == ["experts.w13_weight", "experts.w2_weight"]
    with pytest.raises(ValueError, match="unexpected expert weight 'experts.8.gate_proj.weight'"):
        load("experts.8.gate_proj.weight", w1[0])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens, top_k, hidden", [(1, 1, 16), (37, 2, 40), (300, 3, 64)])
def test_cpu_kernel_matches_the_torch_experts(dtype, tol, tokens, top_k, hidden):
    """One token to a prompt's many (several blocks an expert), hidden sizes on and off the vector width, experts
    with no token (logits favour the first three)."""
    from kernels.cpu_ops import load

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(E, 2 * N, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(E, hidden, N, generator=gen) / N**0.5).to(dtype)
    logits = torch.randn(tokens, E, generator=gen)
    logits[:, :3] += 2.0
    weights, ids = fused_topk(logits, top_k, renormalize=True)
    ours = load().fused_moe(x, w13, w2, weights, ids)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.float(), fused_experts(x, w13, w2, weights, ids).float(), atol=tol, rtol=tol)
    # The torch path's arithmetic in float64: the kernel's float32 sums are within rounding of it.
    exact = fused_experts(x.double(), w13.double(), w2.double(), weights, ids)
    torch.testing.assert_close(ours.double(), exact, atol=tol, rtol=tol)
