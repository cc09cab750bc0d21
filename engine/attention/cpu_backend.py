"""Attention backend on the C++ CPU kernel (kernels/cpu/paged_attention.cpp): one reshape_and_cache and
one paged_attention call per layer for the whole mixed batch, reading K/V in place through the block table
(no per-layer gather, unlike the torch backend). Sliding-window layers read only their window's blocks. A step
whose tokens include a prefix-LM model's image placeholders (mm_prefix_range) runs on the torch backend: the
kernel's mask is causal.

Multi-head latent attention runs on kernels/cpu/mla_decode.cpp, in the absorbed form over the latent cache read in
place, every token as a decode of its own (prompt tokens too): so a token's output is the same whatever its step holds
(batch invariance), at the cost of prefill's cheaper up-projected form.
"""

import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.mla import write_latents
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
        self._torch = TorchAttentionBackend(block_size)  # runs steps with images

    def prepare(self, metadata: AttentionMetadata) -> None:
        metadata.plan = None  # MLA's rows, made by the step's first layer

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
        n = metadata.num_actual_tokens
        write_latents(kv_c[:n], k_pe[:n], kv_cache, metadata.slot_mapping)
        if metadata.plan is None:  # each token a row of its own: its request's blocks and its keys 0..position
            metadata.plan = token_rows(metadata)
        seq_lens, block_table = metadata.plan
        # Every token, decode or prompt, is attended as a decode in the absorbed form by the one kernel: its output
        # does not depend on its step's other tokens, on a chunk boundary or on where its keys came from.
        q_latent = torch.einsum("rhd,hdl->rhl", q_nope[:n], w_uk)
        query = torch.cat([q_latent, q_pe[:n]], dim=-1)
        out = self._ops.mla_decode(query, kv_cache, seq_lens, block_table, w_uk.shape[-1], scale)
        output = q_nope.new_zeros(*q_nope.shape[:2], w_uv.shape[1])
        output[:n] = torch.einsum("rhl,hvl->rhv", out, w_uv)
        return output


def token_rows(metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Each of the step's tokens as a request of one query: its context length (its position + 1) and its request's
    block table row."""
    qsl = metadata.query_start_loc
    num_reqs = metadata.seq_lens.shape[0]
    query_lens = qsl[1 : num_reqs + 1] - qsl[:num_reqs]
    request = torch.repeat_interleave(torch.arange(num_reqs, device=qsl.device), query_lens)
    offset = torch.arange(request.shape[0], device=qsl.device) - qsl[request]
    seq_lens = metadata.seq_lens[request] - query_lens[request] + offset + 1
    return seq_lens.long().contiguous(), metadata.block_table[request].long().contiguous()
