"""The attention-backend seam: the interface every backend implements and the metadata it reads."""

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """The flat batch as attention sees it. Requests are ordered decodes first."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] physical KV slot each token writes
    query_start_loc: torch.Tensor  # [num_reqs + 1] where each request starts in the flat batch
    seq_lens: torch.Tensor  # [num_reqs] context length after this step (cached + new)
    block_table: torch.Tensor  # [num_reqs, max_blocks] physical block ids, padded with 0
    num_decodes: int  # requests [0, num_decodes) have exactly one query token
    # Host copies, so backends never synchronise with the device to read them.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # What the backend's prepare() derived from the above once per step, for every layer to share.
    plan: Any = None


class AttentionBackend:
    """One call per layer: write this step's K/V into the paged cache, then attend."""

    name = "base"
    # Whether a step can be captured in a CUDA graph: launches that depend only on tensor shapes.
    cudagraph_support = False

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Layout of one layer's K (and V) cache, the same for every backend: the KV connector copies blocks
        in it, and a kv head's block is one contiguous [block_size, head_dim] tile for the kernels."""
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Per-step work that depends only on the metadata; called once before the first layer."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],  # (K, V), each of get_kv_cache_shape()
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        raise NotImplementedError
