"""The attention-backend seam: the interface every backend implements and the metadata it reads."""

from dataclasses import dataclass
from typing import Any

import torch

# --kv-cache-dtype's choices but auto, as the cache stores them. fp8 stores with a scale of 1.0 (vLLM's default
# k_scale and v_scale): a float's relative precision does not depend on a scale, which only moves the range, and
# K and V stay well inside fp8_e4m3's (docs/models.md); the stores saturate at its largest value.
KV_CACHE_TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if name == "auto" else KV_CACHE_TORCH_DTYPES[name]


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
    # A prefix-LM model's images (Gemma 3): request row -> the [start, end) positions of each image whose
    # placeholders this step's tokens touch; a query there also sees the keys of its own image that follow it.
    mm_prefix_range: dict[int, list[tuple[int, int]]] | None = None


def layer_metadata(
    backend: "AttentionBackend", metadata: list[AttentionMetadata], layer_to_group: list[int]
) -> list[AttentionMetadata]:
    """Each layer's metadata, for a model's forward: its KV cache group's (engine.kv.kv_cache_spec), each group's
    prepared once for the step, so models need not know the groups."""
    for group_metadata in metadata:
        backend.prepare(group_metadata)
    return [metadata[g] for g in layer_to_group]


class AttentionBackend:
    """One call per layer: write this step's K/V into the paged cache, then attend."""

    name = "base"
    # Whether a step can be captured in a CUDA graph: launches that depend only on tensor shapes.
    cudagraph_support = False
    # What forward() implements beyond causal attention: "sliding_window", "logits_soft_cap", "sinks",
    # "mm_prefix" (AttentionMetadata.mm_prefix_range); "mla": forward_mla().
    features: frozenset[str] = frozenset()

    def kv_cache_dtypes(self, device: torch.device) -> tuple[torch.dtype, ...]:
        """The KV cache dtypes it reads on this device (and writes from any model dtype)."""
        return (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)

    def check_kv_cache_dtype(self, dtype: torch.dtype, device: torch.device) -> None:
        """At start-up: a clear error where this backend cannot read a KV cache of this dtype on this device."""
        readable = self.kv_cache_dtypes(device)
        if dtype not in readable:
            names = ", ".join(str(d).removeprefix("torch.") for d in readable)
            raise ValueError(
                f"--kv-cache-dtype: the {self.name} attention backend cannot read a {str(dtype).removeprefix('torch.')} "
                f"KV cache on {device.type}; it reads {names}. Pick another --kv-cache-dtype or --attention-backend."
            )

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
        sliding_window: int | None = None,  # attend to the last sliding_window keys only (None: all)
        logits_soft_cap: float | None = None,  # scores become cap * tanh(score / cap) before the softmax
        sinks: torch.Tensor | None = None,  # [num_heads] float32: a logit per head added to the softmax's denominator
    ) -> torch.Tensor:
        raise NotImplementedError

    def forward_mla(
        self,
        q_nope: torch.Tensor,  # [num_tokens, num_heads, qk_nope_head_dim]
        q_pe: torch.Tensor,  # [num_tokens, num_heads, qk_rope_head_dim], rotary applied
        kv_c: torch.Tensor,  # [num_tokens, kv_lora_rank]: the normalised latent
        k_pe: torch.Tensor,  # [num_tokens, qk_rope_head_dim]: the rotary key, shared by the heads
        kv_cache: torch.Tensor,  # engine.attention.mla.mla_kv_cache_shape()
        metadata: AttentionMetadata,
        scale: float,
        w_uk: torch.Tensor,  # [num_heads, qk_nope_head_dim, kv_lora_rank]: the latent's up-projection to K
        w_uv: torch.Tensor,  # [num_heads, v_head_dim, kv_lora_rank]: and to V
    ) -> torch.Tensor:
        """Multi-head latent attention (engine/attention/mla.py): write this step's latents, attend, and return
        [num_tokens, num_heads, v_head_dim]. Backends with "mla" among their features implement it."""
        raise NotImplementedError
