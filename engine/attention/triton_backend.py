"""Attention backend on the Triton kernels (kernels/): one reshape_and_cache and one unified_attention
launch per layer, for the whole mixed batch, reading K/V in place through the block table.

Every launch depends only on tensor shapes (and on a layer's window and soft-cap, fixed), and prepare()
has nothing to do, so a step can be captured in a CUDA graph and replayed with new metadata contents.
"""

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from kernels.reference import to_cache_dtype


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    cudagraph_support = True
    features = frozenset({"sliding_window", "logits_soft_cap"})

    def __init__(self, block_size: int):
        # Imported here, so that the selector imports on machines without triton.
        from kernels.reshape_and_cache import reshape_and_cache
        from kernels.unified_attention import unified_attention

        self.block_size = block_size
        self._reshape_and_cache, self._unified_attention = reshape_and_cache, unified_attention

    def kv_cache_dtypes(self, device: torch.device) -> tuple[torch.dtype, ...]:
        dtypes = super().kv_cache_dtypes(device)
        # Triton converts fp8_e4m3 on GPUs of compute capability 8.9 (Ada, Hopper) and later only.
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            return tuple(d for d in dtypes if d != torch.float8_e4m3fn)
        return dtypes

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
        sinks: torch.Tensor | None = None,  # not in features: the selector never gives this backend a model with them
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache
        key, value = to_cache_dtype(key, k_cache.dtype), to_cache_dtype(value, v_cache.dtype)
        self._reshape_and_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        output = torch.empty_like(query)
        batch = metadata.query_start_loc, metadata.seq_lens, metadata.block_table
        self._unified_attention(output, query, k_cache, v_cache, *batch, scale, sliding_window, logits_soft_cap)
        return output
