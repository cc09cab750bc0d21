"""Attention backend on the C++ CPU kernel (kernels/cpu/paged_attention.cpp): one reshape_and_cache and
one paged_attention call per layer for the whole mixed batch, reading K/V in place through the block table
(no per-layer gather, unlike the torch backend). Sliding-window layers read only their window's blocks. A step
whose tokens include a prefix-LM model's image placeholders (mm_prefix_range) runs on the torch backend: the
kernel's mask is causal.

Multi-head latent attention decodes on kernels/cpu/mla_decode.cpp, in the absorbed form over the latent cache read in
place; its prefill rows (compute-bound) are up-projected in torch, as the torch backend does them.
"""

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.mla import mla_forward
from engine.attention.torch_backend import TorchAttentionBackend
from kernels.reference import to_cache_dtype


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    cudagraph_support = False
    features = frozenset({"sliding_window", "logits_soft_cap", "mla", "sinks", "mm_prefix"})

    def __init__(self, block_size: int):
        # Imported here: loading may build the kernel, which only this backend needs.
        from kernels.cpu_ops import load

        self.block_size = block_size
        self._ops = load()
        self._torch = TorchAttentionBackend(block_size)  # plans MLA's prefill rows; runs steps with images both ways

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.plan = None  # MLA's prefill plan, made by the step's first layer

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
        if metadata.mm_prefix_range:
            return self._torch.forward(
                query, key, value, kv_cache, metadata, scale, sliding_window, logits_soft_cap, sinks
            )
        k_cache, v_cache = kv_cache
        n = metadata.num_actual_tokens
        key, value = to_cache_dtype(key[:n], k_cache.dtype), to_cache_dtype(value[:n], v_cache.dtype)
        self._ops.reshape_and_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        batch = metadata.query_start_loc, metadata.seq_lens, metadata.block_table
        if sinks is not None:
            sinks = sinks.float().contiguous()  # a no-op for a float32 model
        return self._ops.paged_attention(query, k_cache, v_cache, *batch, scale, sliding_window, logits_soft_cap, sinks)

    def forward_mla(self, q_nope, q_pe, kv_c, k_pe, kv_cache, metadata: AttentionMetadata, scale, w_uk, w_uv):
        nd = metadata.num_decodes
        if metadata.plan is None:  # the prefill rows' plan, once a step; the decodes are the kernel's
            metadata.plan = ([], self._torch._plan(metadata, None)[1])
        output = mla_forward(q_nope, q_pe, kv_c, k_pe, kv_cache, metadata, metadata.plan, scale, w_uk, w_uv)
        if nd:  # decode rows come first, one token each
            q_latent = torch.einsum("rhd,hdl->rhl", q_nope[:nd], w_uk)
            query = torch.cat([q_latent, q_pe[:nd]], dim=-1)
            rank = w_uk.shape[-1]
            out = self._ops.mla_decode(query, kv_cache, metadata.seq_lens[:nd], metadata.block_table[:nd], rank, scale)
            output[:nd] = torch.einsum("rhl,hvl->rhv", out, w_uv)
        return output
