"""Triton unified paged attention: one launch per layer for a whole mixed batch.

Decodes, prefill chunks and prefix-cache hits are the same thing here: request r's query rows
query_start_loc[r]:query_start_loc[r+1] are the last ones of its seq_lens[r] tokens, and each attends
causally to the keys before it, read in place from the paged cache through the block table. With a
sliding window W a query at position q sees keys q - W + 1..q only, and each program's key loop starts
at its first query's window (what lies before is never read); with a logit soft-cap c each score s
becomes c * tanh(s / c) before the softmax; with sinks (gpt-oss) head h's softmax has one more logit, sinks[h], that
attends to no value: the running max and sum start from it, as if it were a key of value zero.

Each program takes BLOCK_Q query tokens of one request and one KV head, with all GROUP query heads
that share it (BLOCK_M = BLOCK_Q * GROUP rows), so each K/V tile is loaded once for the group. Keys come
in tiles of TILE positions, independent of the block size: every key looks up its own block. Tiles sit at fixed
positions (multiples of TILE) and a row's keys are never split across programs, so a query's output is the same
whether it is a decode, a prefill row or a row over a cached prefix, whatever else shares the launch.

The launch configuration depends only on tensor shapes, never on their contents, so a launch captured
in a CUDA graph stays valid as the batch changes; the kernel reads where each request starts and how long
it is from the device.
"""

import math

import torch
import triton
import triton.language as tl

TILE = 32  # keys per inner step
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows


@triton.jit
def _tanh(x):
    # tanh from exp2 (the interpreter has no libdevice): exp2 overflowing to inf still gives 1.
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # 2 * log2(e)


@triton.jit
def online_softmax_step(s, v, m, l, acc, PRECISION: tl.constexpr):  # noqa: E741
    """One tile of keys into the running softmax: scores s [rows, keys] (log2 units, -inf where hidden) and values
    v [keys, dims] into the running max m, sum l and output acc of each row. Returns the new (m, l, acc).
    A tile a row sees nothing of leaves its m, l and acc exactly as they were (m stays -inf until a key is seen), so
    a row's result does not depend on how many such tiles its program reads (batch invariance)."""
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep exp2 finite, its p is 0
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, 1)  # noqa: E741
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _unified_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_table_ptr,
    sinks_ptr,  # [num_heads] float32, read only with USE_SINKS
    qk_scale,  # softmax scale * log2(e) (the kernel uses exp2); with a soft-cap, scale / cap
    soft_cap_log2,  # the soft-cap * log2(e)
    num_reqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_ch,
    stride_cb,  # cache [num_kv_heads, num_blocks, block_size, head_dim], contiguous
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    USE_SOFT_CAP: tl.constexpr,
    USE_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE: tl.constexpr,
    DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)

    # Request r owns programs from query_start_loc[r] // BLOCK_Q + r on: at least ceil(q_len / BLOCK_Q)
    # of them. Find this program's request: the last r whose first program is <= pid.
    lo: tl.int32 = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid).to(tl.int32) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    req = lo - 1
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + req + 1).to(tl.int32) - q_start
    first_q = (pid - (q_start // BLOCK_Q + req)) * BLOCK_Q
    if first_q >= q_len:  # a spare program (or a request with no query rows)
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    num_cached = seq_len - q_len

    # Row m is query token first_q + m // GROUP, query head kv_head * GROUP + m % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = first_q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = num_cached + q_idx  # each query token's position in its sequence
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_off = (q_start + q_idx).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of the scores (log2 units)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741 (running sum of exp2(score - m), the papers' l)
    if USE_SINKS:  # the sink is the first logit seen: exp2(sink - m) = 1
        m = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634  # log2(e)
        l = tl.full([BLOCK_M], 1.0, tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # Causal: no row here sees past this block's last query token.
    kv_end = tl.minimum(seq_len, num_cached + first_q + BLOCK_Q)
    # Sliding window: no row here sees before the first query token's window. Tiles start at multiples of TILE,
    # whatever the program's first query: each key meets the same tile-mates in a decode and in a prefill.
    # The keys before the window in the first tile are masked, never read: their blocks may be another request's.
    kv_first = 0
    if SLIDING_WINDOW > 0:
        kv_first = tl.maximum(num_cached + first_q - SLIDING_WINDOW + 1, 0)
    kv_start = kv_first // TILE * TILE
    cache_head = kv_head.to(tl.int64) * stride_ch
    block_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, TILE):
        pos = start + tl.arange(0, TILE)
        key_ok = (pos >= kv_first) & (pos < kv_end)
        block = tl.load(block_row + pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv_off = cache_head + block * stride_cb + (pos % BLOCK_SIZE) * HEAD_DIM
        k = tl.load(k_cache_ptr + kv_off[None, :] + dims[:, None], mask=dim_ok[:, None] & key_ok[None, :], other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + dims[None, :], mask=key_ok[:, None] & dim_ok[None, :], other=0.0)
        # In the query's dtype (float32 with DOT_F32): a cache of another dtype (--kv-cache-dtype) is converted here.
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
        if USE_SOFT_CAP:
            s = soft_cap_log2 * _tanh(s)
        visible = row_ok[:, None] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            visible &= pos[None, :] > q_pos[:, None] - SLIDING_WINDOW
        s = tl.where(visible, s, float("-inf"))
        m, l, acc = online_softmax_step(s, v, m, l, acc, PRECISION)  # noqa: E741

    # A padding request (seq_len 0) saw no key: l is 0 (or the sink's alone) and its output is 0, not NaN.
    acc = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_off = (q_start + q_idx).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])


def unified_attention(
    out,
    query,
    k_cache,
    v_cache,
    query_start_loc,
    seq_lens,
    block_table,
    scale,
    sliding_window=None,
    soft_cap=None,
    sinks=None,
) -> None:
    """out[rows of request r] = causal attention of those query rows over the request's first seq_lens[r]
    cached tokens (the last sliding_window of them, where given), each score s made soft_cap * tanh(s / soft_cap)
    where given, with head h's sink logit sinks[h] (float32 [num_heads]) in its softmax where given. query/out [num_tokens, num_heads, head_dim]; caches [num_kv_heads, num_blocks, block_size,
    head_dim]; block_table [num_reqs, max_blocks]. Rows of no request are not written."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    num_reqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0 and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert query.stride(2) == 1 and out.stride(2) == 1 and block_table.stride(1) == 1
    if num_tokens == 0 or num_reqs == 0:
        return
    group = num_heads // num_kv_heads
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(group))
    block_q = block_m // group
    # Under the interpreter (CPU tensors) numpy has no bfloat16 arithmetic: do the dots in float32.
    # float32 inputs use exact float32 dots, not TF32.
    dot_f32 = query.device.type == "cpu" or query.dtype == torch.float32
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    assert sliding_window is None or sliding_window > 0
    assert soft_cap is None or soft_cap > 0
    assert sinks is None or (sinks.dtype == torch.float32 and sinks.shape == (num_heads,))
    # With a soft-cap the dot is scaled by scale / cap, so that tanh takes it as it is, then by cap * log2(e).
    qk_scale = scale * math.log2(math.e) if soft_cap is None else scale / soft_cap
    soft_cap_log2 = (soft_cap or 0.0) * math.log2(math.e)
    _unified_attention_kernel[grid](
        out,
        query,
        k_cache,
        v_cache,
        query_start_loc,
        seq_lens,
        block_table,
        query if sinks is None else sinks,  # any pointer where there are none: never read
        qk_scale,
        soft_cap_log2,
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        SLIDING_WINDOW=sliding_window or 0,
        USE_SOFT_CAP=soft_cap is not None,
        USE_SINKS=sinks is not None,
        BLOCK_M=block_m,
        TILE=TILE,
        DOT_F32=dot_f32,
        PRECISION="ieee" if dot_f32 else "tf32",
    )
