"""Triton multi-head latent attention (MLA: DeepSeek-V2 and V3) over the paged latent cache.

The cache is [num_blocks, block_size, kv_lora_rank + qk_rope_head_dim], contiguous: a token's entry is its latent c
and its rotary key k_pe, one vector shared by every head (engine/attention/mla.py).

- concat_and_cache_mla writes this step's c and k_pe into their slots (vLLM's name), skipping padding (slot -1).
- mla_decode attends one query token per request in the absorbed form: the query is q_nope·W_UK beside q_pe, so
  head h's score against a cached entry is q_latent[h]·c + q_pe[h]·k_pe, and the output is the softmax's mix of the
  c's, in latent space (the caller applies W_UV). Every head reads the same entries, so a program takes BLOCK_H
  heads of one request and loads each tile of TILE entries once for all of them, using it as the keys and (its
  first kv_lora_rank columns) as the values.

Prefill rows (many queries, compute-bound) are up-projected instead and run through the unified attention kernel
(engine/attention/triton_backend.py). Launches depend only on tensor shapes, so a decode step can be captured in a
CUDA graph.
"""

import math

import torch
import triton
import triton.language as tl

from kernels.unified_attention import online_softmax_step

MIN_DOT = 16  # tl.dot needs at least 16 along every dimension


@triton.jit
def _concat_and_cache_mla_kernel(
    kv_c_ptr,
    k_pe_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_ct,
    stride_pt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    entry = cache_ptr + slot * (RANK + ROPE)  # contiguous: slot s is entry s of the flattened blocks
    c_dims = tl.arange(0, RANK_PAD)
    c = tl.load(kv_c_ptr + token * stride_ct + c_dims, mask=c_dims < RANK)
    tl.store(entry + c_dims, c, mask=c_dims < RANK)
    p_dims = tl.arange(0, ROPE_PAD)
    pe = tl.load(k_pe_ptr + token * stride_pt + p_dims, mask=p_dims < ROPE)
    tl.store(entry + RANK + p_dims, pe, mask=p_dims < ROPE)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping) -> None:
    """Token i's [kv_c[i], k_pe[i]] (already in the cache's dtype) to slot slot_mapping[i]; slot -1 is padding."""
    num_tokens = slot_mapping.shape[0]
    rank, rope = kv_c.shape[-1], k_pe.shape[-1]
    assert kv_cache.is_contiguous() and kv_cache.shape[-1] == rank + rope
    assert kv_c.stride(-1) == 1 and k_pe.stride(-1) == 1
    if num_tokens == 0:
        return
    _concat_and_cache_mla_kernel[(num_tokens,)](
        kv_c,
        k_pe,
        kv_cache,
        slot_mapping,
        kv_c.stride(0),
        k_pe.stride(0),
        RANK=rank,
        ROPE=rope,
        RANK_PAD=triton.next_power_of_2(rank),
        ROPE_PAD=triton.next_power_of_2(rope),
    )


@triton.jit
def _mla_decode_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    seq_lens_ptr,
    block_table_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel uses exp2
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    TILE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)

    c_dims = tl.arange(0, RANK_PAD)
    p_dims = tl.arange(0, ROPE_PAD)
    c_ok, p_ok = c_dims < RANK, p_dims < ROPE
    q_row = q_ptr + req.to(tl.int64) * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_row + c_dims[None, :], mask=head_ok[:, None] & c_ok[None, :], other=0.0)
    q_p = tl.load(q_row + RANK + p_dims[None, :], mask=head_ok[:, None] & p_ok[None, :], other=0.0)
    if DOT_F32:
        q_c = q_c.to(tl.float32)
        q_p = q_p.to(tl.float32)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741 (running sum of exp2(score - m))
    acc = tl.zeros([BLOCK_H, RANK_PAD], tl.float32)
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(0, seq_len, TILE):
        pos = start + tl.arange(0, TILE)
        key_ok = pos < seq_len
        block = tl.load(block_row + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        entry = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * (RANK + ROPE)
        c = tl.load(cache_ptr + entry[:, None] + c_dims[None, :], mask=key_ok[:, None] & c_ok[None, :], other=0.0)
        pe = tl.load(
            cache_ptr + entry[:, None] + RANK + p_dims[None, :], mask=key_ok[:, None] & p_ok[None, :], other=0.0
        )
        # In the query's dtype: a cache of another dtype (--kv-cache-dtype) is converted here.
        c = c.to(q_c.dtype)
        pe = pe.to(q_c.dtype)
        s = tl.dot(q_c, tl.trans(c), input_precision=PRECISION)
        s += tl.dot(q_p, tl.trans(pe), input_precision=PRECISION)
        s = tl.where(key_ok[None, :], s * qk_scale, float("-inf"))
        m, l, acc = online_softmax_step(s, c, m, l, acc, PRECISION)  # noqa: E741

    # A padding request (seq_len 0) saw no entry: its output is 0, not NaN.
    acc = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_off = req.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + c_dims[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & c_ok[None, :])


def mla_decode(out, query, kv_cache, seq_lens, block_table, kv_lora_rank: int, scale: float) -> None:
    """out[r] = head by head, the softmax over request r's first seq_lens[r] cached entries of query[r]·entry * scale,
    mixing the entries' latents. query [R, H, kv_lora_rank + qk_rope] (absorbed: q_nope·W_UK beside q_pe); out
    [R, H, kv_lora_rank]; kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope]; block_table [R, max_blocks]."""
    num_reqs, num_heads, head_size = query.shape
    _, block_size, cache_head_size = kv_cache.shape
    rope = head_size - kv_lora_rank
    assert cache_head_size == head_size and kv_cache.is_contiguous()
    assert query.stride(2) == 1 and out.stride(2) == 1 and block_table.stride(1) == 1
    if num_reqs == 0:
        return
    rank_pad = max(MIN_DOT, triton.next_power_of_2(kv_lora_rank))
    # 16 heads a program: with a 512-wide latent, their float32 accumulator alone is 32 KiB of registers.
    block_h = MIN_DOT
    # Under the interpreter (CPU tensors) numpy has no bfloat16 arithmetic: dots in float32, as for float32 inputs
    # (exact, not TF32).
    dot_f32 = query.device.type == "cpu" or query.dtype == torch.float32
    grid = (num_reqs, triton.cdiv(num_heads, block_h))
    _mla_decode_kernel[grid](
        out,
        query,
        kv_cache,
        seq_lens,
        block_table,
        scale * math.log2(math.e),
        num_heads,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        RANK=kv_lora_rank,
        ROPE=rope,
        RANK_PAD=rank_pad,
        ROPE_PAD=max(MIN_DOT, triton.next_power_of_2(rope)),
        BLOCK_SIZE=block_size,
        BLOCK_H=block_h,
        # A tile of entries and the [BLOCK_H, RANK_PAD] accumulator stay on chip: fewer entries for wide latents.
        TILE=32 if rank_pad <= 256 else 16,
        DOT_F32=dot_f32,
        PRECISION="ieee" if dot_f32 else "tf32",
    )
