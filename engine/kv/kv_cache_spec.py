"""What each layer keeps in the KV cache (its spec), and the layers grouped by spec (KV cache groups).

A full-attention layer keeps every token; a sliding-window layer needs only the last `sliding_window` tokens, so
its blocks that fall out of the window can be freed. Layers of one spec are split into groups of equal size (as
vLLM does when every layer's page is the same size): each group has its own block table, and group j's layer i
uses the i-th of `group_size` shared KV tensors, so a block id belongs to one group at a time and a block's bytes
are those of group_size layers, not of every layer. A model with one kind of layer is one group.

A multi-head latent attention layer (MLA: DeepSeek-V2 and V3) keeps every token too, but as one compressed vector
shared by all heads instead of per-head K and V: its page is that vector per token, and the block manager treats it
as full attention.
"""

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """Every token of the context stays in the cache."""


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A query attends to the last sliding_window tokens (itself included): older blocks can be freed."""

    sliding_window: int


@dataclass(frozen=True)
class MLAAttentionSpec:
    """Every token stays, as one vector per layer shared by all heads: the latent (kv_lora_rank), from which the
    attention up-projects K and V, and the rotary part of the key (qk_rope_head_dim). No heads, no separate V."""

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def head_size(self) -> int:
        """The elements one token keeps in one layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim


KVCacheSpec = FullAttentionSpec | SlidingWindowSpec | MLAAttentionSpec


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_ids: tuple[int, ...]


def layer_spec(config, layer: int) -> KVCacheSpec:
    """What layer `layer` of the model (config: a ModelArchConfig) keeps."""
    if config.kv_lora_rank is not None:
        return MLAAttentionSpec(config.kv_lora_rank, config.qk_rope_head_dim)
    window = config.layer_sliding_window(layer)
    return FullAttentionSpec() if window is None else SlidingWindowSpec(window)


def kv_cache_groups(config) -> list[KVCacheGroup]:
    """The model's layers (config: a ModelArchConfig) grouped by spec, full attention first; each spec's layers in
    runs of group size, the smallest number of layers any spec has (the last run of a spec may be shorter)."""
    by_spec: dict[KVCacheSpec, list[int]] = {}
    for layer in range(config.num_hidden_layers):
        by_spec.setdefault(layer_spec(config, layer), []).append(layer)
    group_size = min(len(layers) for layers in by_spec.values())
    order = sorted(by_spec, key=lambda s: (isinstance(s, SlidingWindowSpec), getattr(s, "sliding_window", 0)))
    return [
        KVCacheGroup(spec, tuple(by_spec[spec][i : i + group_size]))
        for spec in order
        for i in range(0, len(by_spec[spec]), group_size)
    ]


def group_size(groups: list[KVCacheGroup]) -> int:
    """Layers per group: the KV tensors the groups share."""
    return max(len(g.layer_ids) for g in groups)


def layer_to_group(groups: list[KVCacheGroup]) -> list[int]:
    """Each layer's group, in layer order."""
    owner = {layer: g for g, group in enumerate(groups) for layer in group.layer_ids}
    return [owner[layer] for layer in range(len(owner))]


def layer_to_tensor(groups: list[KVCacheGroup]) -> list[int]:
    """Each layer's index among the shared KV tensors: its place within its group."""
    place = {layer: i for group in groups for i, layer in enumerate(group.layer_ids)}
    return [place[layer] for layer in range(len(place))]


def max_request_len(
    groups: list[KVCacheGroup], num_blocks: int, block_size: int, max_num_new_tokens: int, max_model_len: int
) -> int:
    """The longest request (at most max_model_len tokens) whose blocks fit the pool at once. A full-attention group
    holds one block per block_size tokens; a sliding group at most the window's blocks and a step's new tokens'
    (the blocks before the window are freed as the request advances)."""

    def blocks_held(num_request_blocks: int) -> int:
        held = 0
        for group in groups:
            if isinstance(group.spec, SlidingWindowSpec):
                window = cdiv(group.spec.sliding_window - 1 + max_num_new_tokens, block_size) + 1
                held += min(num_request_blocks, window)
            else:
                held += num_request_blocks
        return held

    lo, hi = 0, cdiv(max_model_len, block_size)
    while lo < hi:  # the most blocks a request may grow to
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if blocks_held(mid) <= num_blocks else (lo, mid - 1)
    return min(max_model_len, lo * block_size)
