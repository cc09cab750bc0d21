"""The Triton mixture-of-experts kernel (kernels/fused_moe.py) against the torch fused_experts
(engine/models/fused_moe.py): the pairs' alignment by expert, the two launches in float32 and bfloat16 with top-k 1
to 4 and experts that no token picks, and on CUDA the FusedMoE layer on it, in a CUDA graph and through the engine.

Without a GPU the kernel runs under TRITON_INTERPRET=1 (set in conftest.py); the same cases run on CUDA when there
is one (marked gpu).
"""

import os

import families
import pytest
import torch
from test_qwen_moe import qwen3_moe

from engine.models.fused_moe import FusedMoE, fused_experts, fused_topk
from kernels.fused_moe import fused_experts as triton_fused_experts
from kernels.fused_moe import get_config, moe_align_block_size

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
# Experts; hidden and intermediate sizes off the tile sizes, so that the K and N edges are masked.
E, H, N = 8, 40, 24
UNUSED = [1, 6]  # experts no token picks


def routed(num_tokens, top_k, seed=0, renormalize=True):
    """Hidden states and a routing (float32 weights, ids) that never picks the UNUSED experts."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, H, generator=gen)
    logits = torch.randn(num_tokens, E, generator=gen)
    logits[:, UNUSED] = float("-inf")
    return (x, *fused_topk(logits, top_k, renormalize))


def random_weights(seed=0):
    """w13 [E, 2N, H], w2 [E, H, N] of about unit output scale; the UNUSED experts' NaN, so reading them shows."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * N, H, generator=gen) / H**0.5
    w2 = torch.randn(E, H, N, generator=gen) / N**0.5
    w13[UNUSED], w2[UNUSED] = float("nan"), float("nan")
    return w13, w2


def test_moe_align_block_size_groups_pairs_by_expert_in_padded_blocks():
    block = 4
    topk_ids = torch.tensor([[3, 0], [3, 7], [0, 3], [5, 3], [3, 0]])  # expert 3: 5 pairs, 0: 3, 5 and 7: 1
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, block, E)
    numel = topk_ids.numel()
    # The length depends on the shape alone: every expert could need a block of padding.
    assert sorted_ids.shape[0] == 36  # 10 pairs + 8 experts * 3, rounded up to blocks
    assert expert_ids.shape[0] == sorted_ids.shape[0] // block
    assert int(num_post) == 4 + 8 + 4 + 4  # experts 0, 3, 5, 7 in order; 3 needs two blocks
    assert expert_ids[:5].tolist() == [0, 3, 3, 5, 7]
    blocks = sorted_ids[: int(num_post)].view(-1, block).tolist()
    # Each expert's pairs in pair order, then padding (numel); no block holds two experts.
    assert blocks == [[1, 4, 9, 10], [0, 2, 5, 7], [8, 10, 10, 10], [6, 10, 10, 10], [3, 10, 10, 10]]
    assert (sorted_ids[int(num_post) :] == numel).all()


def test_moe_align_block_size_holds_every_pair_once():
    _, _, topk_ids = routed(37, 4)
    sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, 16, E)
    real = sorted_ids[sorted_ids < topk_ids.numel()].long()
    assert sorted(real.tolist()) == list(range(topk_ids.numel()))
    for b in range(int(num_post) // 16):
        pairs = sorted_ids[b * 16 : (b + 1) * 16].long()
        pairs = pairs[pairs < topk_ids.numel()]
        assert len(pairs) > 0  # no block of padding alone
        assert (topk_ids.flatten()[pairs] == expert_ids[b]).all()
    assert not set(expert_ids[: int(num_post) // 16].tolist()) & set(UNUSED)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (37, 2), (5, 3), (1, 4), (37, 4)])
def test_fused_experts_matches_torch(device, dtype, num_tokens, top_k):
    """Pairs no more than experts (the decode tiles) and more (the larger tiles), against the torch fused_experts
    in float32 on the same values; the UNUSED experts' NaN weights never reach the output."""
    assert (num_tokens * top_k <= E) == (get_config(num_tokens * top_k, E)["BLOCK_M"] == 16)
    x, topk_weights, topk_ids = routed(num_tokens, top_k, seed=top_k, renormalize=top_k != 3)
    w13, w2 = random_weights()
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    expected = fused_experts(x.float(), w13.float(), w2.float(), topk_weights, topk_ids)
    assert expected.isfinite().all()
    tensors = (t.to(device) for t in (x, w13, w2, topk_weights, topk_ids))
    out = triton_fused_experts(*tensors)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_fused_experts_reads_strided_hidden_states_and_no_tokens(device):
    x, topk_weights, topk_ids = routed(9, 2, seed=5)
    w13, w2 = random_weights()
    wide = torch.randn(9, 2 * H)
    wide[:, 1::2] = x  # x as every other column of a wider tensor
    strided = wide.to(device)[:, 1::2]
    assert strided.stride() == (2 * H, 2)
    args = (w13.to(device), w2.to(device), topk_weights.to(device))
    out = triton_fused_experts(strided, *args, topk_ids.to(device))
    torch.testing.assert_close(out.cpu(), fused_experts(x, w13, w2, topk_weights, topk_ids), atol=1e-5, rtol=1e-5)
    empty = triton_fused_experts(strided[:0], *args[:2], topk_weights[:0].to(device), topk_ids[:0].to(device))
    assert empty.shape == (0, H)


def cuda_moe(top_k=2):
    w13, w2 = random_weights()
    w13[UNUSED], w2[UNUSED] = 0.0, 0.0  # logits below never exclude them here
    moe = FusedMoE(E, top_k, H, N, renormalize=True)
    with torch.no_grad():
        moe.w13_weight.copy_(w13)
        moe.w2_weight.copy_(w2)
    return moe.cuda()


@pytest.mark.gpu
def test_fused_moe_layer_runs_the_triton_kernel_on_cuda():
    moe = cuda_moe()
    gen = torch.Generator().manual_seed(3)
    x, logits = torch.randn(21, H, generator=gen), torch.randn(21, E, generator=gen)
    weights, ids = fused_topk(logits, 2, True)
    expected = fused_experts(x, moe.w13_weight.cpu(), moe.w2_weight.cpu(), weights, ids)
    torch.testing.assert_close(moe(x.cuda(), logits.cuda()).cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    """Captured on one routing and replayed on another: the alignment and the launches read the routing from the
    device, never baking it in."""
    moe = cuda_moe()
    gen = torch.Generator().manual_seed(4)
    x, logits = torch.randn(6, H, generator=gen).cuda(), torch.randn(6, E, generator=gen).cuda()
    moe(x, logits)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe(x, logits)
    x.copy_(torch.randn(6, H, generator=gen))
    logits.copy_(torch.randn(6, E, generator=gen))
    graph.replay()
    weights, ids = fused_topk(logits.cpu(), 2, True)
    expected = fused_experts(x.cpu(), moe.w13_weight.cpu(), moe.w2_weight.cpu(), weights, ids)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_qwen3_moe_on_cuda_matches_hf(tmp_path):
    families.check_greedy_chunked_and_prefix_cached(tmp_path, qwen3_moe(), device="cuda", dtype="float32")
