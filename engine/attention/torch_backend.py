"""Reference attention backend in plain torch; runs anywhere, CPU included."""

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float):
        k_cache, v_cache = kv_cache
        num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
        n = metadata.num_actual_tokens
        # reshape_and_cache: each token's K/V goes to its slot.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, key[:n])
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, metadata.slot_mapping, value[:n])

        output = torch.empty_like(query)
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        nd = metadata.num_decodes
        if nd:
            # All decodes in one padded call: gather each request's blocks, mask past its length.
            max_blocks = -(max(seq_lens[:nd]) // -block_size)
            table = metadata.block_table[:nd, :max_blocks]
            k = k_cache[table].flatten(1, 2).transpose(1, 2)  # [nd, kv_heads, L, D]
            v = v_cache[table].flatten(1, 2).transpose(1, 2)
            positions = torch.arange(k.shape[2], device=k.device)
            mask = (positions[None, :] < metadata.seq_lens[:nd, None])[:, None, None, :]
            q = query[:nd].unsqueeze(2)  # [nd, heads, 1, D]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            output[:nd] = out.squeeze(2)

        for i in range(nd, len(seq_lens)):
            start, end, seq_len = qsl[i], qsl[i + 1], seq_lens[i]
            q = query[start:end].transpose(0, 1)  # [heads, q_len, D]
            num_cached = seq_len - (end - start)
            if num_cached == 0:
                # A whole prompt in this step: attend over the fresh K/V, plain causal.
                k, v = key[start:end].transpose(0, 1), value[start:end].transpose(0, 1)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                # A later chunk or a prefix-cache hit: read the cached context from the pages.
                blocks = metadata.block_table[i, : -(seq_len // -block_size)]
                k = k_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
                v = v_cache[blocks].flatten(0, 1)[:seq_len].transpose(0, 1)
                q_pos = torch.arange(num_cached, seq_len, device=q.device)
                mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            output[start:end] = out.transpose(0, 1)
        return output
