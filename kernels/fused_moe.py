"""Triton fused mixture-of-experts (vLLM's fused_moe): the experts' gated MLPs as two grouped GEMMs over the step's
(token, expert) pairs, the torch reference being engine/models/fused_moe.py's fused_experts.

moe_align_block_size sorts the pairs by expert and pads each expert's run to a multiple of BLOCK_M with a pair index
past the last (num_tokens * top_k), so that every block of BLOCK_M sorted rows belongs to one expert. A program
takes one such block and BLOCK_N output columns: it gathers its rows of the input, multiplies them by its expert's
weight tile, and scatters the results back to the pairs' rows. Experts that no token picked own no block, so their
weights are never read.

Two launches a layer: w13 [E, 2I, H] with the SiLU-and-mul fused (a program keeps the gate and the up tile of the
same columns and stores silu(gate) * up), then w2 [E, H, I] with each pair's router weight applied; the top_k
results of a token are then summed. Grids are sized by the most padded rows the shape can give, and programs past
the step's padded rows return at once: the launches depend on shapes only, never on the routing.
"""

import torch
import triton
import triton.language as tl


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_tokens_post_padded): the flat pair indices t * top_k + k grouped by expert, in
    pair order within an expert, each expert's run padded to a multiple of block_size with the index
    topk_ids.numel(); the expert of each block of sorted_ids; the padded length (one-element tensor). sorted_ids has
    the most rows any routing of this shape can need, so its length depends on the shape only; no host sync."""
    numel = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.flatten()
    max_padded = triton.cdiv(numel + num_experts * (block_size - 1), block_size) * block_size
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.index_add_(0, flat, torch.ones_like(flat))  # no bincount: it reads the max back to the host
    padded_ends = ((counts + block_size - 1) // block_size * block_size).cumsum(0)
    padded_starts = padded_ends - (counts + block_size - 1) // block_size * block_size
    order = flat.argsort(stable=True)
    experts = flat[order]
    firsts = counts.cumsum(0) - counts  # where each expert's pairs start in `order`
    slots = padded_starts[experts] + torch.arange(numel, device=device) - firsts[experts]
    sorted_ids = torch.full((max_padded,), numel, dtype=torch.int32, device=device)
    sorted_ids[slots] = order.to(torch.int32)
    blocks = torch.arange(0, max_padded, block_size, device=device)
    # Blocks past the last expert's are never run; they point at the last expert so that the index stays valid.
    expert_ids = torch.searchsorted(padded_ends, blocks, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return sorted_ids, expert_ids, padded_ends[-1:].to(torch.int32)


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    topk_weights_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_padded_ptr,
    N,
    K,
    num_valid,  # num_tokens * top_k: a sorted index at least this is padding
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    TOP_K: tl.constexpr,  # pairs per row of a: top_k for the hidden states, 1 for the per-pair intermediate
    GATED: tl.constexpr,  # b's rows N.. are the up projection of rows 0..N-1 (gate): store silu(gate) * up
    MUL_ROUTED_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded_ptr):
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = pairs < num_valid
    expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // TOP_K)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None] * stride_bk

    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if DOT_F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_F32:
                up = up.to(tl.float32)
            acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def get_config(num_pairs: int, num_experts: int) -> dict:
    """Tile sizes as vLLM's defaults: small row blocks when the pairs are few per expert (decode), where most of a
    larger block would be padding. tl.dot needs 16 at least in every dimension."""
    if num_pairs <= num_experts:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32)


def _launch(a, b, c, topk_weights, aligned, num_valid, top_k, gated, config, dot_f32):
    sorted_ids, expert_ids, num_post = aligned
    n = b.shape[1] // 2 if gated else b.shape[1]
    grid = (sorted_ids.shape[0] // config["BLOCK_M"], triton.cdiv(n, config["BLOCK_N"]))
    _fused_moe_kernel[grid](
        a,
        b,
        c,
        topk_weights,
        sorted_ids,
        expert_ids,
        num_post,
        n,
        b.shape[2],
        num_valid,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        TOP_K=top_k,
        GATED=gated,
        MUL_ROUTED_WEIGHT=not gated,
        DOT_F32=dot_f32,
        PRECISION="ieee" if dot_f32 else "tf32",
        **config,
    )


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert[topk_ids[t, k]](x[t]), each expert down(silu(gate(x)) * up(x)):
    x [T, H]; w13 [E, 2I, H] (gate rows first); w2 [E, H, I]; topk_weights (float32) and topk_ids [T, top_k]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    assert x.shape == (num_tokens, hidden) and w2.shape == (num_experts, hidden, two_i // 2)
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_pairs = num_tokens * top_k
    config = get_config(num_pairs, num_experts)
    aligned = moe_align_block_size(topk_ids, config["BLOCK_M"], num_experts)
    # Under the interpreter (CPU tensors) numpy has no bfloat16 arithmetic: the dots run in float32 there. float32
    # inputs use exact float32 dots, not TF32.
    dot_f32 = x.device.type == "cpu" or x.dtype == torch.float32
    topk_weights = topk_weights.contiguous()
    intermediate = torch.empty(num_pairs, two_i // 2, dtype=x.dtype, device=x.device)
    _launch(x, w13, intermediate, topk_weights, aligned, num_pairs, top_k, True, config, dot_f32)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _launch(intermediate, w2, out, topk_weights, aligned, num_pairs, 1, False, config, dot_f32)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
