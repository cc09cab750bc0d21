"""BlockPool: every KV block, the free queue, and the prefix-cache lookup table."""

from dataclasses import dataclass

from engine.kv.block import FreeKVCacheBlockQueue, KVCacheBlock


@dataclass
class BlockStored:
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    # Where the blocks now live: "device" (this engine's paged cache) or "kvstore" (the external store).
    medium: str = "device"
    # For blocks that joined the device cache by a load rather than a forward pass: where they came from.
    loaded_from: str | None = None
    # The KV cache group the blocks hold (engine.kv.kv_cache_spec): each group caches a prefix's blocks apart.
    group_id: int = 0
    # The LoRA adapter the blocks were computed under (their hashes carry its digest), for routers that key on it.
    lora_id: int | None = None
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[bytes]
    group_id: int = 0


@dataclass
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """Hands out blocks, counts references, and keeps freed full blocks findable by hash.

    A freed block that holds a cached prefix stays in the hash table until it is reused:
    eviction is lazy and happens when get_new_blocks() pops it off the free queue. The table is keyed by
    (block hash, KV cache group): each group holds its own copy of a prefix's blocks.

    With use_null_block, block 0 is never handed out: a sliding-window group's block table shows it where blocks
    fell out of the window (never written, never read unmasked).
    """

    def __init__(
        self, num_blocks: int, enable_caching: bool, enable_kv_cache_events: bool = False, use_null_block: bool = False
    ):
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft() if use_null_block else None
        # The blocks requests can hold.
        self.num_blocks = num_blocks - (1 if use_null_block else 0)
        self.cached_block_hash_to_block: dict[tuple[bytes, int], KVCacheBlock] = {}
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []

    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get((block_hash, group_id))

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        token_ids: list[int],
        loaded_from: str | None = None,
        group_id: int = 0,
        lora=None,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] of group group_id under their chained hashes (lora:
        the LoRARequest they were computed under, if any)."""
        stored = []
        for i in range(num_cached_blocks, num_full_blocks):
            block, key = blocks[i], (block_hashes[i], group_id)
            if block is self.null_block or block.block_hash is not None:  # out of the window, or a prefix hit
                continue
            if key in self.cached_block_hash_to_block:
                # Another request computed the same block at the same time; keep the first copy.
                continue
            block.block_hash, block.group_id = key
            self.cached_block_hash_to_block[key] = block
            stored.append(i)
        if self.enable_kv_cache_events and stored:
            first = stored[0]
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=[block_hashes[i] for i in stored],
                    parent_block_hash=block_hashes[first - 1] if first > 0 else None,
                    token_ids=token_ids[first * block_size : (stored[-1] + 1) * block_size],
                    block_size=block_size,
                    loaded_from=loaded_from,
                    group_id=group_id,
                    lora_id=None if lora is None else lora.lora_int_id,
                    lora_name=None if lora is None else lora.lora_name,
                )
            )

    def record_event(self, event: KVCacheEvent) -> None:
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(event)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached_block_hash_to_block[block.block_hash, block.group_id]
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved(block_hashes=[block.block_hash], group_id=block.group_id))
        block.block_hash = None

    def evict_blocks(self, blocks: list[KVCacheBlock]) -> None:
        """Forget these blocks' hashes now, so no later request can hit them."""
        for block in blocks:
            self._maybe_evict_cached_block(block)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block is self.null_block:  # held by no one, never free
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks) -> None:
        """Drop a reference; blocks reaching zero join the queue tail in the given order."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds a block."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def take_events(self) -> list[KVCacheEvent]:
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
