"""Multi-head latent attention (MLA: DeepSeek-V2 and V3) over a paged latent cache, in plain torch.

A token keeps one vector per layer, shared by every head: its latent c (kv_lora_rank wide, the normalised kv_a
projection) and its rotary key k_pe (qk_rope_head_dim wide). Head h's key is [W_UK[h] c, k_pe] and its value
W_UV[h] c, W_UK and W_UV being the two parts of the kv_b projection. Attention is computed two equal ways:

- up-projected, for prefill (many queries against about as many keys, compute-bound): every head's K and V are
  made from the latents, then ordinary attention (q·k over qk_nope + qk_rope dims, values of v_head_dim);
- absorbed, for decode (one query against the whole context, bound by reading the cache): q_nope[h] W_UK[h] is a
  query in latent space, so the scores are read off the cached vectors as they are, one key and value head shared by
  every query head (multi-query attention), and W_UV[h] is applied to the output, a mix of latents.
"""

import torch
import torch.nn.functional as F

from kernels.reference import to_cache_dtype


def mla_kv_cache_shape(num_blocks: int, block_size: int, head_size: int) -> tuple[int, ...]:
    """One layer's latent cache: a block is one contiguous [block_size, kv_lora_rank + qk_rope_head_dim] tile."""
    return (num_blocks, block_size, head_size)


def write_latents(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Each token's [c, k_pe] into its slot, in the cache's dtype; the vectors as stored."""
    entry = to_cache_dtype(torch.cat([kv_c, k_pe], dim=-1), kv_cache.dtype)
    # index_copy_ has no kernel for fp8: copy the bytes.
    as_bytes = entry.element_size() == 1
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    (flat.view(torch.uint8) if as_bytes else flat).index_copy_(
        0, slot_mapping, entry.view(torch.uint8) if as_bytes else entry
    )
    return entry


def up_projected_attention(q_nope, q_pe, latents, w_uk, w_uv, scale: float, mask=None) -> torch.Tensor:
    """Queries q_nope [T, H, qk_nope], q_pe [T, H, qk_rope] against the latents [S, kv_lora_rank + qk_rope] of their
    context, K and V up-projected per head (w_uk [H, qk_nope, kv_lora_rank], w_uv [H, v_head_dim, kv_lora_rank]).
    mask [T, S] (True: visible); None: causal over T == S. Returns [T, H, v_head_dim]."""
    num_heads, rank = w_uk.shape[0], w_uk.shape[-1]
    c, k_pe = latents[:, :rank], latents[:, rank:]
    k_nope = torch.einsum("sl,hdl->hsd", c, w_uk)
    key = torch.cat([k_nope, k_pe.expand(num_heads, *k_pe.shape)], dim=-1)
    value = torch.einsum("sl,hvl->hsv", c, w_uv)
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(0, 1)


def absorbed_attention(q_nope, q_pe, latents, w_uk, w_uv, scale: float, mask) -> torch.Tensor:
    """One query per row, q_nope [R, H, qk_nope] and q_pe [R, H, qk_rope], against each row's latents
    [R, S, kv_lora_rank + qk_rope]; mask [R, 1, S] (True: visible). W_UK is folded into the query and W_UV applied
    after: no per-head K or V is made. Returns [R, H, v_head_dim]."""
    rank = w_uk.shape[-1]
    q_latent = torch.einsum("rhd,hdl->rhl", q_nope, w_uk)
    query = torch.cat([q_latent, q_pe], dim=-1)  # [R, H, rank + qk_rope]: the heads as the queries of one KV head
    out = F.scaled_dot_product_attention(query, latents, latents[..., :rank], attn_mask=mask, scale=scale)
    return torch.einsum("rhl,hvl->rhv", out, w_uv)


def mla_forward(q_nope, q_pe, kv_c, k_pe, kv_cache, metadata, plan, scale: float, w_uk, w_uv) -> torch.Tensor:
    """Write this step's latents, then attend: decode rows absorbed, the others (prefill chunks, spec-decode
    verification) up-projected. plan: the torch backend's full-attention plan for the step (its decode groups and
    prefill rows). Returns [tokens, H, v_head_dim]."""
    n = metadata.num_actual_tokens
    fresh = write_latents(kv_c[:n], k_pe[:n], kv_cache, metadata.slot_mapping).to(q_nope.dtype)
    output = q_nope.new_empty(*q_nope.shape[:2], w_uv.shape[1])
    decodes, prefills = plan
    for group in decodes:
        latents = kv_cache[group.table].flatten(1, 2).to(q_nope.dtype)  # [R, padded context, head_size]
        index = group.index
        output[index] = absorbed_attention(q_nope[index], q_pe[index], latents, w_uk, w_uv, scale, group.mask[0])
    for row in prefills:
        rows = slice(row.start, row.end)
        if row.blocks is None:  # a whole prompt this step: its latents as stored
            latents, mask = fresh[rows], None
        else:  # a later chunk or a prefix-cache hit: the cached context from the pages
            seq_len = row.mask.shape[1]
            latents, mask = kv_cache[row.blocks].flatten(0, 1)[:seq_len].to(q_nope.dtype), row.mask
        output[rows] = up_projected_attention(q_nope[rows], q_pe[rows], latents, w_uk, w_uv, scale, mask)
    return output
