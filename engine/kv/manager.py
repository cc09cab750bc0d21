"""KVCacheManager: which blocks each request holds, prefix-cache lookups, allocation.

A request holds one list of blocks per KV cache group (engine.kv.kv_cache_spec), all from one BlockPool; each
group's spec says which of its blocks a prefix hit needs and which it may drop (engine.kv.single_type_manager).
A model with one kind of layer has one group, and that group's list is what it always was.
"""

from dataclasses import dataclass

from engine.kv.block import KVCacheBlock
from engine.kv.block_pool import AllBlocksCleared, BlockPool, BlockStored, KVCacheEvent
from engine.kv.hashing import get_hash_fn, root_hash, update_block_hashes
from engine.kv.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv
from engine.kv.single_type_manager import make_manager
from engine.request import Request

__all__ = ["KVCacheManager", "PrefixCacheStats", "cdiv"]


@dataclass
class PrefixCacheStats:
    """Counted in tokens, as vLLM's prefix-cache hit rate is; the scheduler records each request once, when it
    is first admitted (not on every step it waits)."""

    queries: int = 0
    hits: int = 0

    def record(self, num_tokens: int, num_hits: int) -> None:
        self.queries += num_tokens
        self.hits += num_hits


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
        watermark: float = 0.0,
        enable_kv_cache_events: bool = False,
        lora_digests: dict[int, bytes] | None = None,
        kv_cache_specs: list[KVCacheSpec] | None = None,
        rope_switch_len: int | None = None,
    ):
        """kv_cache_specs: each KV cache group's spec (default: one full-attention group). rope_switch_len: past this
        many tokens a request's KV is rotated with the model's other rope (ModelArchConfig.rope_switch_len), so its
        blocks are named apart."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        specs = kv_cache_specs or [FullAttentionSpec()]
        sliding = any(isinstance(spec, SlidingWindowSpec) for spec in specs)
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events, use_null_block=sliding)
        self.managers = [make_manager(spec, g, self.block_pool, block_size) for g, spec in enumerate(specs)]
        self.hash_fn = get_hash_fn(hash_algo)
        self.root_hash = root_hash(self.hash_fn, hash_seed)
        # Blocks held back from admissions so running requests can keep growing.
        self.watermark_blocks = int(watermark * num_blocks)
        # request id -> its blocks, one list per KV cache group.
        self.req_to_blocks: dict[str, list[list[KVCacheBlock]]] = {}
        # How many of a request's blocks are already registered in the prefix cache (in every group).
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # LoRA adapter id -> digest of its weights: the extra key of its requests' block hashes.
        self.lora_digests = lora_digests if lora_digests is not None else {}
        self.rope_switch_len = rope_switch_len

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.managers)

    @property
    def num_blocks(self) -> int:
        """The blocks requests can hold (the null block, where there is one, is not among them)."""
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[list[KVCacheBlock]], int]:
        """Each group's blocks of the longest cached prefix of full blocks on which every group agrees, capped so at
        least one token is computed (vLLM's hybrid coordinator); and that prefix's length in tokens."""
        empty = [[] for _ in self.managers]
        if not self.enable_caching:
            return empty, 0
        self._update_block_hashes(request)
        # The last token must run through the model to produce logits.
        hit_length = (request.num_tokens - 1) // self.block_size * self.block_size
        # A group's hit shorter than the others' shortens theirs; a sliding group must then look again (its hit
        # needs the blocks just before its end), until every group agrees.
        while True:
            hits = [m.find_longest_cache_hit(request.block_hashes, hit_length) for m in self.managers]
            shortest = min(len(blocks) for blocks in hits) * self.block_size
            if shortest == hit_length:
                return hits, hit_length
            hit_length = shortest

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[list[KVCacheBlock]] | None = None,
        apply_watermark: bool = False,
        delay_cache_blocks: bool = False,
    ) -> list[list[KVCacheBlock]] | None:
        """Make room for `num_new_tokens` more tokens; each group's new blocks, or None (allocating nothing) if the
        pool is short. Blocks that fell out of a sliding window are freed first (their tokens are never read again).

        delay_cache_blocks: the new tokens' blocks are being loaded by a KV connector, so they join the
        prefix cache only once they have arrived (cache_blocks).
        """
        new_computed_blocks = new_computed_blocks or [[] for _ in self.managers]
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is not None:
            for manager, blocks in zip(self.managers, req_blocks):
                manager.remove_skipped_blocks(blocks, request.num_computed_tokens)
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required_blocks = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        held = req_blocks or [[] for _ in self.managers]
        num_new_blocks = [
            max(0, num_required_blocks - len(blocks) - len(hits)) for blocks, hits in zip(held, new_computed_blocks)
        ]
        # Prefix hits sitting in the free queue stop being free once touched.
        null = self.block_pool.null_block
        num_evictable_hits = sum(1 for hits in new_computed_blocks for b in hits if b.ref_cnt == 0 and b is not null)
        watermark = self.watermark_blocks if apply_watermark else 0
        if sum(num_new_blocks) + num_evictable_hits + watermark > self.block_pool.get_num_free_blocks():
            return None

        req_blocks = self.req_to_blocks.setdefault(request.request_id, held)
        new_blocks = []
        for blocks, hits, n in zip(req_blocks, new_computed_blocks, num_new_blocks):
            self.block_pool.touch(hits)
            blocks.extend(hits)
            new_blocks.append(self.block_pool.get_new_blocks(n))
            blocks.extend(new_blocks[-1])
        # Register the blocks this step fills; only tokens already known can be hashed.
        self.cache_blocks(request, num_computed_tokens if delay_cache_blocks else num_computed_tokens + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int, loaded_from: str | None = None) -> None:
        """Register the request's full blocks up to num_tokens in the prefix cache, in every group (loaded_from:
        where the blocks' contents came from, when not from this engine's own forward pass)."""
        if not self.enable_caching:
            return
        self._update_block_hashes(request)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full > num_cached:
            for group_id, blocks in enumerate(self.req_to_blocks[request.request_id]):
                self.block_pool.cache_full_blocks(
                    blocks,
                    request.block_hashes,
                    num_cached,
                    num_full,
                    self.block_size,
                    request.all_token_ids,
                    loaded_from,
                    group_id,
                    request.lora_request,
                )
            self.num_cached_block[request.request_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        lora = request.lora_request
        lora_key = None if lora is None else self.lora_digests[lora.lora_int_id]
        # The scheduler recomputes a request that grows past the switch, its hashes dropped: all of them are renamed.
        switch = self.rope_switch_len
        rope_key = b"long" if switch is not None and request.num_tokens > switch else None
        update_block_hashes(request, self.block_size, self.hash_fn, self.root_hash, lora_key, rope_key)

    def free(self, request: Request) -> None:
        """Release a request's blocks in every group, tail-first, so its unique tail is evicted before shared
        prefix."""
        for blocks in self.req_to_blocks.pop(request.request_id, []):
            self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def evict_cached_blocks(self, request: Request) -> None:
        """Take a request's blocks out of the prefix cache: their contents cannot be trusted."""
        for blocks in self.req_to_blocks.get(request.request_id, []):
            self.block_pool.evict_blocks(blocks)

    def get_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block table rows, one per group (the null block's id where a window let blocks go)."""
        blocks = self.req_to_blocks.get(request_id) or [[] for _ in self.managers]
        return [[b.block_id for b in group] for group in blocks]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def snapshot_events(self, max_blocks_per_event: int) -> list[KVCacheEvent]:
        """The prefix cache as events, for a new subscriber to start from: AllBlocksCleared, then BlockStored of the
        cached blocks' hashes (their token ids are not kept), at most max_blocks_per_event to an event, per group."""
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for group_id in range(len(self.managers)):
            hashes = [h for h, g in self.block_pool.cached_block_hash_to_block if g == group_id]
            events += [
                BlockStored(hashes[i : i + max_blocks_per_event], None, [], self.block_size, group_id=group_id)
                for i in range(0, len(hashes), max_blocks_per_event)
            ]
        return events
