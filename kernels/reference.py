"""Plain torch references for the kernels: slow, obvious, float32 inside."""

import torch


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it: rounded to nearest even, saturating at the dtype's largest finite value
    (as vLLM's fp8 stores do, with a scale of 1.0), so an outlier is clipped instead of becoming inf or NaN."""
    if x.dtype == dtype:
        return x
    largest = torch.finfo(dtype).max
    return x.clamp(-largest, largest).to(dtype)


def reshape_and_cache_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Write token i's K/V [num_kv_heads, head_dim] to slot slot_mapping[i]; slot -1 is padding."""
    block_size = k_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[:, slot // block_size, slot % block_size] = to_cache_dtype(key[i], k_cache.dtype)
        v_cache[:, slot // block_size, slot % block_size] = to_cache_dtype(value[i], v_cache.dtype)


def paged_attention_ref(
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
) -> torch.Tensor:
    """Causal attention of each request's query tokens over its first seq_len cached tokens.

    query [num_tokens, num_heads, head_dim]; caches [num_kv_heads, num_blocks, block_size, head_dim];
    block_table [num_reqs, max_blocks]. Rows of no request are left zero. With sliding_window W, the query at
    position q sees keys q - W + 1..q only; with soft_cap c, a score s becomes c * tanh(s / c); with sinks
    [num_heads], head h's softmax has one more logit, sinks[h], whose probability is dropped (gpt-oss).
    Keys outside every window are still read, so they must be finite here.
    """
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, _, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float32)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        start, end = starts[r], starts[r + 1]
        if end == start:
            continue
        blocks = block_table[r, : -(seq_len // -block_size)]
        k = k_cache[:, blocks].flatten(1, 2)[:, :seq_len].float().repeat_interleave(group, 0)  # [H, S, D]
        v = v_cache[:, blocks].flatten(1, 2)[:, :seq_len].float().repeat_interleave(group, 0)
        q = query[start:end].float().transpose(0, 1)  # [H, Q, D]
        scores = q @ k.transpose(1, 2) * scale
        if soft_cap is not None:
            scores = torch.tanh(scores / soft_cap) * soft_cap
        q_pos = torch.arange(seq_len - (end - start), seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        hidden = k_pos > q_pos
        if sliding_window is not None:
            hidden |= k_pos <= q_pos - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, end - start, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[start:end] = (probs @ v).transpose(0, 1)
    return out.to(query.dtype)


def mla_decode_ref(query, kv_cache, seq_lens, block_table, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """Absorbed multi-head latent attention, one query token per request: head h of request r attends with
    query[r, h] [kv_lora_rank + qk_rope] over the request's first seq_len cached entries [kv_lora_rank + qk_rope] of
    kv_cache [num_blocks, block_size, kv_lora_rank + qk_rope], and mixes their latents (first kv_lora_rank values).
    Returns [num_reqs, num_heads, kv_lora_rank]; a request of no entries gets zeros."""
    block_size = kv_cache.shape[1]
    out = torch.zeros(*query.shape[:2], kv_lora_rank, dtype=torch.float32)
    for r, seq_len in enumerate(seq_lens.tolist()):
        blocks = block_table[r, : -(seq_len // -block_size)]
        entries = kv_cache[blocks].flatten(0, 1)[:seq_len].float()  # [S, kv_lora_rank + qk_rope]
        if seq_len:
            probs = (query[r].float() @ entries.T * scale).softmax(-1)
            out[r] = probs @ entries[:, :kv_lora_rank]
    return out.to(query.dtype)
