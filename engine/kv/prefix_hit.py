"""Which cached blocks a prefix hit needs, per KV cache group spec, and the longest prefix every group agrees on
(vLLM's hybrid KV cache coordinator). Pure functions over "is block i of group g cached": the local prefix cache
asks its block pool, a KV connector asks its store, and both follow the same rules.

- full attention: every block of the prefix;
- a sliding window of W: only the blocks of the W - 1 tokens before the hit's end (what the next query sees);
  the blocks before them are never read again;
- the hit: the longest prefix on which every group agrees. A sliding group's hit does not hold for a shorter
  prefix (its window moves back), so a shorter agreement is looked up again until it holds everywhere.
"""

from collections.abc import Callable

from engine.kv.kv_cache_spec import KVCacheSpec, SlidingWindowSpec, cdiv


def window_blocks(spec: KVCacheSpec, block_size: int) -> int | None:
    """The blocks right before a hit's end that the group needs; None: every block of the prefix."""
    if isinstance(spec, SlidingWindowSpec):
        return cdiv(spec.sliding_window - 1, block_size)
    return None


def needed_blocks(spec: KVCacheSpec, block_size: int, num_blocks: int) -> range:
    """The blocks of a hit of num_blocks blocks that the group reads again."""
    window = window_blocks(spec, block_size)
    return range(0 if window is None else max(0, num_blocks - window), num_blocks)


def longest_group_hit(spec: KVCacheSpec, block_size: int, is_cached: Callable[[int], bool], max_blocks: int) -> int:
    """The longest hit, in blocks (at most max_blocks), that one group can serve: full attention the leading run of
    cached blocks; a sliding window the rightmost run of cached blocks as long as its window (searched from the
    right), or a run from the start."""
    window = window_blocks(spec, block_size)
    if window is None:
        n = 0
        while n < max_blocks and is_cached(n):
            n += 1
        return n
    run = 0
    for i in range(max_blocks - 1, -1, -1):
        if not is_cached(i):
            run = 0
            continue
        run += 1
        if run >= window:
            return i + run
    return run


def longest_common_hit(
    specs: list[KVCacheSpec], block_size: int, is_cached: Callable[[int, int], bool], max_blocks: int
) -> int:
    """The longest hit, in blocks (at most max_blocks), on which every group agrees; is_cached(group, block)."""
    while True:
        hit = min(
            longest_group_hit(spec, block_size, lambda i, g=g: is_cached(g, i), max_blocks)
            for g, spec in enumerate(specs)
        )
        if hit == max_blocks:
            return hit
        max_blocks = hit
