"""KVCacheManager: which blocks each request holds, prefix-cache lookups, allocation."""

from dataclasses import dataclass

from engine.kv.block import KVCacheBlock
from engine.kv.block_pool import AllBlocksCleared, BlockPool, BlockStored, KVCacheEvent
from engine.kv.hashing import get_hash_fn, root_hash, update_block_hashes
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


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
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, enable_kv_cache_events)
        self.hash_fn = get_hash_fn(hash_algo)
        self.root_hash = root_hash(self.hash_fn, hash_seed)
        # Blocks held back from admissions so running requests can keep growing.
        self.watermark_blocks = int(watermark * num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's blocks are already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # LoRA adapter id -> digest of its weights: the extra key of its requests' block hashes.
        self.lora_digests = lora_digests if lora_digests is not None else {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks, capped so at least one token is computed."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request)
        # The last token must run through the model to produce logits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        apply_watermark: bool = False,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens; None (allocating nothing) if the pool is short.

        delay_cache_blocks: the new tokens' blocks are being loaded by a KV connector, so they join the
        prefix cache only once they have arrived (cache_blocks).
        """
        new_computed_blocks = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        num_required_blocks = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(new_computed_blocks))
        # Prefix hits sitting in the free queue stop being free once touched.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        watermark = self.watermark_blocks if apply_watermark else 0
        if num_new_blocks + num_evictable_hits + watermark > self.block_pool.get_num_free_blocks():
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        self.block_pool.touch(new_computed_blocks)
        req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        # Register the blocks this step fills; only tokens already known can be hashed.
        self.cache_blocks(request, num_computed_tokens if delay_cache_blocks else num_computed_tokens + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int, loaded_from: str | None = None) -> None:
        """Register the request's full blocks up to num_tokens in the prefix cache (loaded_from: where the
        blocks' contents came from, when not from this engine's own forward pass)."""
        if not self.enable_caching:
            return
        self._update_block_hashes(request)
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                self.req_to_blocks[request.request_id],
                request.block_hashes,
                num_cached,
                num_full,
                self.block_size,
                request.all_token_ids,
                loaded_from,
            )
            self.num_cached_block[request.request_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        lora = request.lora_request
        lora_key = None if lora is None else self.lora_digests[lora.lora_int_id]
        update_block_hashes(request, self.block_size, self.hash_fn, self.root_hash, lora_key)

    def free(self, request: Request) -> None:
        """Release a request's blocks tail-first, so its unique tail is evicted before shared prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def evict_cached_blocks(self, request: Request) -> None:
        """Take a request's blocks out of the prefix cache: their contents cannot be trusted."""
        self.block_pool.evict_blocks(self.req_to_blocks.get(request.request_id, []))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.block_pool.take_events()

    def snapshot_events(self, max_blocks_per_event: int) -> list[KVCacheEvent]:
        """The prefix cache as events, for a new subscriber to start from: AllBlocksCleared, then BlockStored of the
        cached blocks' hashes (their token ids are not kept), at most max_blocks_per_event to an event."""
        hashes = list(self.block_pool.cached_block_hash_to_block)
        stored = [
            BlockStored(hashes[i : i + max_blocks_per_event], None, [], self.block_size)
            for i in range(0, len(hashes), max_blocks_per_event)
        ]
        return [AllBlocksCleared(), *stored]
