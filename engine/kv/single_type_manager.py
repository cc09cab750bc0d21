"""Per-spec block rules of one KV cache group: which cached blocks a prefix hit needs, which blocks a request
may drop as it advances (vLLM's FullAttentionManager and SlidingWindowManager). The group's blocks per request
are kept by KVCacheManager; these rules read and edit those lists."""

from engine.kv.block import KVCacheBlock
from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_spec import KVCacheSpec, SlidingWindowSpec, cdiv


class FullAttentionManager:
    def __init__(self, group_id: int, block_pool: BlockPool, block_size: int):
        self.group_id = group_id
        self.block_pool = block_pool
        self.block_size = block_size

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """The cached blocks of the longest prefix of at most max_length tokens: every block of it must be cached."""
        blocks = []
        for block_hash in block_hashes[: max_length // self.block_size]:
            block = self.block_pool.get_cached_block(block_hash, self.group_id)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def remove_skipped_blocks(self, blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Every block stays needed."""


class SlidingWindowManager(FullAttentionManager):
    def __init__(self, group_id: int, block_pool: BlockPool, block_size: int, sliding_window: int):
        super().__init__(group_id, block_pool, block_size)
        self.sliding_window = sliding_window
        # A hit ending at a block boundary needs the blocks of the W - 1 tokens the next query sees before it.
        self.contiguous_blocks = cdiv(sliding_window - 1, block_size)

    def find_longest_cache_hit(self, block_hashes: list[bytes], max_length: int) -> list[KVCacheBlock]:
        """The longest hit of at most max_length tokens whose last contiguous_blocks blocks are cached (searched from
        the right); the blocks before them are the null block. A run of cached blocks from the start is a hit too."""
        null = self.block_pool.null_block
        num_blocks = max_length // self.block_size
        blocks = [null] * num_blocks
        run = 0
        for i in range(num_blocks - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            blocks[i] = block
            run += 1
            if run >= self.contiguous_blocks:
                return blocks[: i + run]
        return blocks[:run]

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
