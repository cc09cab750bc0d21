"""Per-spec block rules of one KV cache group: which cached blocks a prefix hit needs, which blocks a request
may drop as it advances (vLLM's FullAttentionManager and SlidingWindowManager). The group's blocks per request
are kept by KVCacheManager; these rules read and edit those lists."""

from engine.kv.block import KVCacheBlock
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from engine.kv.prefix_hit import longest_group_hit, needed_blocks


class FullAttentionManager:
    def __init__(self, group_id: int, block_pool: BlockPool, block_size: int):
        self.group_id = group_id
        self.block_pool = block_pool
        self.block_size = block_size
        self.spec: KVCacheSpec = FullAttentionSpec()

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of at most max_length tokens that this group can serve, by its
        spec's rule (engine.kv.prefix_hit, which KV connectors follow too); the null block where it needs none."""
        pool, g = self.block_pool, self.group_id
        num_blocks = longest_group_hit(
            self.spec, self.block_size, lambda i: pool.get_cached_block(block_hashes[i], g) is not None,
            max_length // self.block_size,
        )  # fmt: skip
        blocks = [pool.null_block] * num_blocks
        for i in needed_blocks(self.spec, self.block_size, num_blocks):
            blocks[i] = pool.get_cached_block(block_hashes[i], g)
        return blocks

    def remove_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Every block stays needed."""


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, group_id: int, block_pool: BlockPool, block_size: int, sliding_window: int):
        super().__init__(group_id, block_pool, block_size)
        self.sliding_window = sliding_window
        self.spec = SlidingWindowSpec(sliding_window)

    def remove_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Free the blocks wholly before the window of the next query (position num_computed_tokens), tail-first
        (the newest of them is evicted last), leaving the null block in their place."""
        num_skipped = (num_computed_tokens - self.sliding_window + 1) // self.block_size
        null = self.block_pool.null_block
        skipped = []
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:  # freed at an earlier step, as everything before it
                break
            skipped.append(blocks[i])
            blocks[i] = null
        self.block_pool.free_blocks(skipped)


def make_manager(spec: KVCacheSpec, group_id: int, block_pool: BlockPool, block_size: int) -> FullAttentionManager:
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(group_id, block_pool, block_size, spec.sliding_window)
    return FullAttentionManager(group_id, block_pool, block_size)
