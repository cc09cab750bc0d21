"""Attention backend on the Triton kernels (kernels/): one reshape_and_cache and one unified_attention
launch per layer, for the whole mixed batch, reading K/V in place through the block table.

Multi-head latent attention (engine/attention/mla.py) writes the step's latents with concat_and_cache_mla, decodes
absorbed with mla_decode over the latent cache in place (kernels/mla_attention.py), and up-projects the prefill
rows' contexts, block by block, to per-head K and V that unified_attention reads as a paged cache of their own.

Every decode launch depends only on tensor shapes (and on a layer's window, soft-cap and sinks, fixed), so a decode
step can be captured in a CUDA graph and replayed with new metadata contents.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels.reference import to_cache_dtype


@dataclass
class MLAPrefillPlan:
    """The step's prefill rows (requests num_decodes on) as unified_attention reads them from up-projected K/V."""

    blocks: torch.Tensor  # [B]: the latent cache's blocks of their contexts, request after request
    block_table: torch.Tensor  # [prefill requests, max blocks]: each request's blocks among those B
    query_start_loc: torch.Tensor  # [prefill requests + 1], from the first prefill row
    seq_lens: torch.Tensor  # [prefill requests]
    start: int  # the first prefill row of the flat batch
    end: int


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cudagraph_support = True
    features = frozenset({"sliding_window", "logits_soft_cap", "sinks", "mla"})

    def __init__(self, block_size: int):
        # Imported here, so that the selector imports on machines without triton.
        from kernels.mla_attention import concat_and_cache_mla, mla_decode
        from kernels.reshape_and_cache import reshape_and_cache
        from kernels.unified_attention import unified_attention

        self.block_size = block_size
        self._reshape_and_cache, self._unified_attention = reshape_and_cache, unified_attention
        self._concat_and_cache_mla, self._mla_decode = concat_and_cache_mla, mla_decode

    def kv_cache_dtypes(self, device: torch.device) -> tuple[torch.dtype, ...]:
        dtypes = super().kv_cache_dtypes(device)
        # Triton converts fp8_e4m3 on GPUs of compute capability 8.9 (Ada, Hopper) and later only.
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            return tuple(d for d in dtypes if d != torch.float8_e4m3fn)
        return dtypes

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.plan = None  # MLA's prefill plan, made by the step's first layer that needs it

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        key, value = to_cache_dtype(key, k_cache.dtype), to_cache_dtype(value, v_cache.dtype)
        self._reshape_and_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        batch = metadata.query_start_loc, metadata.seq_lens, metadata.block_table
        if sinks is not None:
            sinks = sinks.float()  # a no-op for a float32 model
        self._unified_attention(output, query, k_cache, v_cache, *batch, scale, sliding_window, logits_soft_cap, sinks)
        return output

    def forward_mla(self, q_nope, q_pe, kv_c, k_pe, kv_cache, metadata: AttentionMetadata, scale, w_uk, w_uv):
        n, nd = metadata.num_actual_tokens, metadata.num_decodes
        rank = w_uk.shape[-1]
        kv_c, k_pe = to_cache_dtype(kv_c[:n], kv_cache.dtype), to_cache_dtype(k_pe[:n], kv_cache.dtype)
        self._concat_and_cache_mla(kv_c, k_pe, kv_cache, metadata.slot_mapping)
        output = q_nope.new_empty(*q_nope.shape[:2], w_uv.shape[1])
        if nd:  # decode rows come first, one token each: absorbed
            q_latent = torch.einsum("rhd,hdl->rhl", q_nope[:nd], w_uk)
            query = torch.cat([q_latent, q_pe[:nd]], dim=-1)
            out = q_latent.new_empty(q_latent.shape)
            self._mla_decode(out, query, kv_cache, metadata.seq_lens[:nd], metadata.block_table[:nd], rank, scale)
            output[:nd] = torch.einsum("rhl,hvl->rhv", out, w_uv)
        if metadata.query_start_loc_cpu[nd] < n:
            if metadata.plan is None:
                metadata.plan = self._prefill_plan(metadata)
            self._mla_prefill(q_nope, q_pe, kv_cache, metadata.plan, scale, w_uk, w_uv, output)
        return output

    def _prefill_plan(self, metadata: AttentionMetadata) -> MLAPrefillPlan:
        nd, bs = metadata.num_decodes, self.block_size
        num_blocks = [-(s // -bs) for s in metadata.seq_lens_cpu[nd:]]
        blocks = torch.cat([metadata.block_table[nd + i, :b] for i, b in enumerate(num_blocks)])
        table = torch.zeros(len(num_blocks), max(num_blocks), dtype=torch.int64)
        first = 0
        for i, b in enumerate(num_blocks):
            table[i, :b] = torch.arange(first, first + b)
            first += b
        start = metadata.query_start_loc_cpu[nd]
        return MLAPrefillPlan(
            blocks,
            table.to(blocks.device),
            metadata.query_start_loc[nd:] - start,
            metadata.seq_lens[nd:],
            start,
            metadata.num_actual_tokens,
        )

    def _mla_prefill(self, q_nope, q_pe, kv_cache, plan: MLAPrefillPlan, scale, w_uk, w_uv, output) -> None:
        """The prefill rows up-projected: each head's K [W_UK c, k_pe] and V W_UV c made for the blocks of their
        contexts (cached and this step's), V padded to K's width, then causal paged attention over them."""
        rank, num_heads = w_uk.shape[-1], w_uk.shape[0]
        latents = kv_cache[plan.blocks].to(q_nope.dtype)  # [B, block_size, kv_lora_rank + qk_rope]
        c, k_pe = latents[..., :rank], latents[..., rank:]
        k_nope = torch.einsum("bsl,hdl->hbsd", c, w_uk)
        key = torch.cat([k_nope, k_pe.expand(num_heads, *k_pe.shape)], dim=-1).contiguous()
        value = torch.einsum("bsl,hvl->hbsv", c, w_uv)
        value = F.pad(value, (0, key.shape[-1] - value.shape[-1])).contiguous()
        rows = slice(plan.start, plan.end)
        query = torch.cat([q_nope[rows], q_pe[rows]], dim=-1)
        out = torch.empty_like(query)
        self._unified_attention(out, query, key, value, plan.query_start_loc, plan.seq_lens, plan.block_table, scale)
        output[rows] = out[..., : w_uv.shape[1]]
