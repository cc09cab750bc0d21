"""Triton reshape_and_cache: this step's K/V rows written into their slots of the paged cache."""

import triton
import triton.language as tl


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,  # key/value [num_tokens, num_kv_heads, head_dim]
    stride_ch,
    stride_cb,  # cache [num_kv_heads, num_blocks, block_size, head_dim], contiguous
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    # One program per token, all of its KV heads at once.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    heads = tl.arange(0, HEADS_PAD)[:, None].to(tl.int64)
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dst = heads * stride_ch + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * HEAD_DIM + dims
    k = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Token i's K/V [num_kv_heads, head_dim] to slot slot_mapping[i] (block slot // block_size,
    offset slot % block_size); slot -1 is padding. One launch; its configuration depends only on shapes."""
    num_kv_heads, _, block_size, head_dim = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    assert key.stride(2) == 1 and value.stride(2) == 1
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )
