"""Attention backend on the C++ CPU kernel (kernels/cpu/paged_attention.cpp): one reshape_and_cache and
one paged_attention call per layer for the whole mixed batch, reading K/V in place through the block table
(no per-layer gather, unlike the torch backend). Sliding-window layers read only their window's blocks.
"""

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels.reference import to_cache_dtype


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"
    cudagraph_support = False
    features = frozenset({"sliding_window", "logits_soft_cap", "sinks"})

    def __init__(self, block_size: int):
        # Imported here: loading may build the kernel, which only this backend needs.
        from kernels.cpu_ops import load

        self.block_size = block_size
        self._ops = load()

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
        n = metadata.num_actual_tokens
        key, value = to_cache_dtype(key[:n], k_cache.dtype), to_cache_dtype(value[:n], v_cache.dtype)
        self._ops.reshape_and_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        batch = metadata.query_start_loc, metadata.seq_lens, metadata.block_table
        if sinks is not None:
            sinks = sinks.float().contiguous()  # a no-op for a float32 model
        return self._ops.paged_attention(query, k_cache, v_cache, *batch, scale, sliding_window, logits_soft_cap, sinks)
