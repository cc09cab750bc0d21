"""KV cache blocks and the free-block queue (a doubly linked list with O(1) removal)."""

from dataclasses import dataclass


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    # Number of running requests that use this block.
    ref_cnt: int = 0
    # Set once the block is full and registered in the prefix cache.
    block_hash: bytes | None = None
    # The KV cache group it is cached for (with block_hash, its key in the prefix cache).
    group_id: int = 0
    prev_free_block: "KVCacheBlock | None" = None
    next_free_block: "KVCacheBlock | None" = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order: the head is evicted first (least recently used).

    The links live inside the blocks themselves, so a cached block that gets a prefix
    hit can be taken out of the middle of the queue in O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        # Sentinels keep every real block's neighbours non-None.
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        prev = self.head
        for block in blocks:
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, self.tail.prev_free_block = self.tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free_block
        if block is self.tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"remove() called on a block that is not free: {block}")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free_block
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self.tail.prev_free_block = self.tail, block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        blocks, block = [], self.head.next_free_block
        while block is not self.tail:
            blocks.append(block)
            block = block.next_free_block
        return blocks
