"""Reference attention backend in plain torch; runs anywhere, CPU included.

The cache is laid out [num_kv_heads, num_blocks, block_size, head_dim] per layer, so gathering
a batch's blocks gives [num_kv_heads, num_reqs, tokens, head_dim] in one contiguous copy, with
no transpose. Decode steps are memory-bound on that gather, so it is done once, for as few
padded tokens as possible.
"""

import bisect
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.attention.mla import mla_forward
from kernels.reference import to_cache_dtype

# Decodes are grouped by context length so a short request is not padded to the longest one.
MAX_DECODE_GROUPS = 4


def decode_groups(seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Decode rows sorted by length, cut where a cut saves the most padded blocks.

    Cuts stop when one would save under a tenth of the padded total: each group costs
    another round of small ops per layer.
    """
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    blocks = [-(seq_lens[i] // -block_size) for i in order]
    cuts = [0, len(order)]
    for _ in range(MAX_DECODE_GROUPS - 1):
        padded = sum((hi - lo) * blocks[hi - 1] for lo, hi in zip(cuts, cuts[1:]))
        best_saved, best_cut = 0, None
        for lo, hi in zip(cuts, cuts[1:]):
            for cut in range(lo + 1, hi):
                saved = (cut - lo) * (blocks[hi - 1] - blocks[cut - 1])
                if saved > best_saved:
                    best_saved, best_cut = saved, cut
        if best_cut is None or best_saved * 10 < padded:
            break
        bisect.insort(cuts, best_cut)
    return [order[lo:hi] for lo, hi in zip(cuts, cuts[1:])]


def _copyable(t: torch.Tensor) -> torch.Tensor:
    """t, or its bytes where index_copy_ has no kernel for its dtype (fp8)."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


@dataclass
class DecodeGroup:
    index: torch.Tensor  # [R] rows of the batch
    table: torch.Tensor  # [R, blocks] their block tables, cut to the group's longest
    mask: torch.Tensor  # [1, R, 1, L] key positions each row may see


@dataclass
class PrefillRow:
    start: int
    end: int
    blocks: torch.Tensor | None  # None: a whole prompt this step, attend to the fresh K/V
    mask: torch.Tensor | None  # [q_len, seq_len] causal mask over cached + new tokens


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    features = frozenset({"sliding_window", "logits_soft_cap", "sinks", "mla", "mm_prefix"})

    def __init__(self, block_size: int):
        self.block_size = block_size

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Plans are made per sliding window (None: full attention) by the first layer that needs one."""
        metadata.plan = {}

    def _plan(self, metadata: AttentionMetadata, window: int | None):
        """Groups, block tables and masks for the step; every layer of the same window reuses them. A key at
        position k is visible to a query at q when k <= q or both lie in one image's range (mm_prefix_range), and,
        in a window W, k > q - W (Hugging Face's rule). A decode row needs no image range: no key follows it."""
        bs, dev, nd = self.block_size, metadata.block_table.device, metadata.num_decodes
        decodes = []
        for rows in decode_groups(metadata.seq_lens_cpu[:nd], bs) if nd else []:
            index = torch.tensor(rows, device=dev)
            max_len = max(metadata.seq_lens_cpu[r] for r in rows)
            positions = torch.arange(-(max_len // -bs) * bs, device=dev)[None, :]
            seq_lens = metadata.seq_lens[index, None]
            mask = positions < seq_lens
            if window is not None:
                mask &= positions >= seq_lens - window
            decodes.append(DecodeGroup(index, metadata.block_table[index, : -(max_len // -bs)], mask[None, :, None, :]))
        prefills = []
        for i in range(nd, len(metadata.seq_lens_cpu)):
            start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
            seq_len = metadata.seq_lens_cpu[i]
            num_cached = seq_len - (end - start)
            images = (metadata.mm_prefix_range or {}).get(i, ())
            if num_cached == 0 and window is None and not images:
                prefills.append(PrefillRow(start, end, None, None))
                continue
            q_pos = torch.arange(num_cached, seq_len, device=dev)[:, None]
            k_pos = torch.arange(seq_len, device=dev)[None, :]
            mask = k_pos <= q_pos
            for lo, hi in images:
                mask |= (q_pos >= lo) & (q_pos < hi) & (k_pos >= lo) & (k_pos < hi)
            if window is not None:
                mask &= k_pos > q_pos - window
            blocks = metadata.block_table[i, : -(seq_len // -bs)] if num_cached else None
            prefills.append(PrefillRow(start, end, blocks, mask))
        return decodes, prefills

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
    ):
        k_cache, v_cache = kv_cache
        num_kv_heads, _, block_size, head_dim = k_cache.shape
        n = metadata.num_actual_tokens
        # reshape_and_cache: each token's K/V goes to its slot, in the cache's dtype. A whole prompt then attends
        # to the K/V as stored, as the kernels that read it from the cache do.
        key, value = to_cache_dtype(key[:n], k_cache.dtype), to_cache_dtype(value[:n], v_cache.dtype)
        _copyable(k_cache).view(num_kv_heads, -1, head_dim).index_copy_(
            1, metadata.slot_mapping, _copyable(key).transpose(0, 1)
        )
        _copyable(v_cache).view(num_kv_heads, -1, head_dim).index_copy_(
            1, metadata.slot_mapping, _copyable(value).transpose(0, 1)
        )
        key, value = key.to(query.dtype), value.to(query.dtype)

        output = torch.empty_like(query)
        if metadata.plan is None:
            metadata.plan = {}
        if sliding_window not in metadata.plan:
            metadata.plan[sliding_window] = self._plan(metadata, sliding_window)
        decodes, prefills = metadata.plan[sliding_window]
        attend = F.scaled_dot_product_attention
        if logits_soft_cap is not None or sinks is not None:
            attend = partial(explicit_attention, logits_soft_cap)
        for group in decodes:
            # GQA folded: the sinks of a KV head's G query heads, in the layout of its G queries.
            extra = {} if sinks is None else {"sinks": sinks.view(num_kv_heads, 1, -1, 1)}
            self._decode(query, output, k_cache, v_cache, group, scale, partial(attend, **extra))
        extra = {} if sinks is None else {"sinks": sinks.view(-1, 1, 1)}
        for row in prefills:
            self._prefill(query, key, value, output, k_cache, v_cache, row, scale, attend, extra)
        return output

    def forward_mla(self, q_nope, q_pe, kv_c, k_pe, kv_cache, metadata: AttentionMetadata, scale, w_uk, w_uv):
        if metadata.plan is None:
            metadata.plan = {}
        if None not in metadata.plan:
            metadata.plan[None] = self._plan(metadata, None)
        return mla_forward(q_nope, q_pe, kv_c, k_pe, kv_cache, metadata, metadata.plan[None], scale, w_uk, w_uv)

    @staticmethod
    def _decode(query, output, k_cache, v_cache, group: DecodeGroup, scale, attend):
        """One query token per request. GQA is folded: a KV head's G query heads act as G queries."""
        num_kv_heads, _, _, head_dim = k_cache.shape
        rows, num_heads = len(group.index), query.shape[1]
        k = k_cache[:, group.table].flatten(2, 3).to(query.dtype)  # [kv_heads, R, L, D]
        v = v_cache[:, group.table].flatten(2, 3).to(query.dtype)
        q = query[group.index].view(rows, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
        out = attend(q, k, v, attn_mask=group.mask, scale=scale)  # [kv_heads, R, G, D]
        output[group.index] = out.transpose(0, 1).reshape(rows, num_heads, head_dim)

    @staticmethod
    def _prefill(query, key, value, output, k_cache, v_cache, row: PrefillRow, scale, attend, extra):
        q = query[row.start : row.end].transpose(0, 1)  # [heads, q_len, D]
        if row.blocks is None:
            # A whole prompt in this step: attend over the fresh K/V (plain causal when there is no mask).
            k, v = key[row.start : row.end].transpose(0, 1), value[row.start : row.end].transpose(0, 1)
            if row.mask is None and attend is F.scaled_dot_product_attention:
                out = attend(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                mask = row.mask if row.mask is not None else causal_mask(row.end - row.start, q.device)
                out = attend(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True, **extra)
        else:
            # A later chunk or a prefix-cache hit: read the cached context from the pages.
            seq_len = row.mask.shape[1]
            k = k_cache[:, row.blocks].flatten(1, 2)[:, :seq_len].to(q.dtype)
            v = v_cache[:, row.blocks].flatten(1, 2)[:, :seq_len].to(q.dtype)
            out = attend(q, k, v, attn_mask=row.mask, scale=scale, enable_gqa=True, **extra)
        output[row.start : row.end] = out.transpose(0, 1)


def causal_mask(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def explicit_attention(
    cap: float | None, q, k, v, attn_mask, scale: float, enable_gqa: bool = False, sinks: torch.Tensor | None = None
):
    """Attention with what scaled_dot_product_attention lacks, in Hugging Face's order: Gemma 2's logit soft-capping,
    cap * tanh(scores / cap), after the scale and before the mask; gpt-oss's sinks, one more logit a head in the
    softmax (float32) whose probability is dropped. q [..., Hq, L, D] against k and v [..., Hkv, S, D]; attn_mask
    broadcasts over [L, S], sinks over the scores' [..., L, 1]."""
    if k.shape[-3] != q.shape[-3]:  # GQA: each KV head serves a run of query heads
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        sink = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)
