"""Which engine replica a request goes to: KV-cache-aware routing over the engines' KV events.

Each engine streams its KV cache events (llmmesh.v1.Engine/SubscribeKvEvents: BlockStored, BlockRemoved,
AllBlocksCleared, with their medium). KVBlockIndex keeps from them which engines hold which block hash in their
paged cache, and which hashes are in the kvstore they share. The Router names a prompt's full blocks exactly as the
engines do (engine/kv/hashing.py, with the algorithm, seed and block size from their ModelInfo, and the request's
cache_salt), matches them against the index, and picks by one policy (--routing):

- prefix-aware: the lowest engine_cost (below): the blocks it would still compute, plus the work already there;
- least-loaded: the fewest requests in flight from this gateway;
- round-robin: each healthy engine in turn.

Ties go to the engines in turn. The index is a hint, never trusted for output: an event lost, late or duplicated, or
an engine restarted, at worst sends a request where its prefix is not, and that engine computes it (a cache miss).
A new event stream starts from nothing, AllBlocksCleared empties an engine's entries, and an unhealthy engine's
entries are dropped.

A model whose layers form several KV cache groups caches each prefix block once per group under the same hash, and
its events name the group. The index keeps ROUTING_GROUP's alone (another group's eviction of a hash would drop it):
groups are numbered full attention first, so that is a full-attention group whenever the model has one, and its
leading run of blocks is the prefix the engine hits (a sliding group needs fewer). With only sliding-window groups
it is a sliding group: a leading run of its blocks is still a hit (it holds the window before its end), so the index
never credits an engine with a prefix it lacks; it misses a hit whose first blocks the engine has already evicted. The index holds at most max_blocks hashes (MAX_INDEX_BLOCKS), each within INDEX_ENTRY_BYTES, so
32 MiB at most; past it, the least recently stored or matched hash is forgotten.
"""

import collections
import dataclasses
import logging

from engine.kv.hashing import extend_block_hashes, get_hash_fn, root_hash
from llmmesh.v1 import engine_pb2

logger = logging.getLogger("llmmesh.gateway")

ROUTING_POLICIES = ("prefix-aware", "least-loaded", "round-robin")
MAX_INDEX_BLOCKS = 1 << 17  # hashes in the index: 2M tokens of 16-token blocks across every engine and the store
INDEX_ENTRY_BYTES = 256  # one entry: its 32-byte hash as a bytes object and its slot in the ordered dict
DEFAULT_KV_LOAD_COST = 0.5  # loading a block over computing it, until the engine has measured both
DECODE_COST_BLOCKS = 1.0  # a request decoding on an engine lengthens its steps about as much as a block of prefill
KV_USAGE_SOFT_LIMIT = 0.9  # past it an engine evicts cached prefixes and may preempt
STORE = 1  # the index's bit for "in the kvstore"; engine i has bit 1 << (i + 1)
ROUTING_GROUP = 0  # the KV cache group whose blocks the index keeps (see above)


@dataclasses.dataclass
class EngineLoad:
    """What the router knows of one engine's load: its own requests there (fresh), and GetLoad's figures (polled)."""

    num_prefilling: int = 0  # requests sent there that have no first token yet
    prefill_blocks: float = 0.0  # the blocks those still compute, as estimated when they were sent
    num_decoding: int = 0  # requests sent there past their first token
    num_waiting: int = 0  # GetLoad: requests in its waiting queue, from any client
    kv_cache_usage: float = 0.0  # GetLoad: 0..1
    kv_load_cost: float | None = None  # GetLoad: measured time to load a block from the kvstore over computing it

    @property
    def num_in_flight(self) -> int:
        return self.num_prefilling + self.num_decoding


def blocks_to_compute(local_blocks: int, store_blocks: int, num_blocks: int, load: EngineLoad) -> float:
    """The prompt's full blocks this engine would still have to compute, a block from the kvstore counted at its
    measured load cost (a fraction of computing it)."""
    load_cost = DEFAULT_KV_LOAD_COST if load.kv_load_cost is None else min(max(load.kv_load_cost, 0.0), 1.0)
    return num_blocks - local_blocks - store_blocks * (1.0 - load_cost)


def engine_cost(num_blocks: int, local_blocks: int, store_blocks: int, load: EngineLoad) -> float:
    """The prefix-aware policy: what sending a prompt of num_blocks full blocks to this engine costs, in blocks of
    prefill; the lowest cost wins.

    - the blocks it would compute: the prompt's leading blocks in its own cache (local_blocks) count in full, the
      next leading ones in the kvstore (store_blocks) at the engine's measured load cost (blocks_to_compute);
    - the work already there, which runs in the same steps: the blocks still to prefill of the requests this
      gateway sent there, DECODE_COST_BLOCKS per request of them decoding, and per request waiting in its queue
      (GetLoad) one more prompt like this one;
    - its KV usage (GetLoad): past KV_USAGE_SOFT_LIMIT, up to the whole prompt again at a full cache, where it
      would evict the prefixes it holds and preempt.
    """
    own = blocks_to_compute(local_blocks, store_blocks, num_blocks, load)
    queued = load.prefill_blocks + DECODE_COST_BLOCKS * load.num_decoding + num_blocks * load.num_waiting
    pressure = max(0.0, load.kv_cache_usage - KV_USAGE_SOFT_LIMIT) / (1.0 - KV_USAGE_SOFT_LIMIT)
    return own + queued + pressure * num_blocks


class KVBlockIndex:
    """Block hash -> a bit mask: which engines hold it in their paged cache (bit i + 1 for engine i), and whether
    the kvstore holds it (STORE). At most max_blocks hashes; the least recently touched is forgotten first."""

    def __init__(self, num_engines: int, max_blocks: int = MAX_INDEX_BLOCKS):
        self.num_engines = num_engines
        self.max_blocks = max_blocks
        self.blocks: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self.blocks)

    def _add(self, block_hash: bytes, bits: int) -> None:
        self.blocks[block_hash] = self.blocks.get(block_hash, 0) | bits
        self.blocks.move_to_end(block_hash)
        if len(self.blocks) > self.max_blocks:
            self.blocks.popitem(last=False)

    def _remove(self, block_hash: bytes, bits: int) -> None:
        mask = self.blocks.get(block_hash, 0) & ~bits
        if mask:
            self.blocks[block_hash] = mask
        else:
            self.blocks.pop(block_hash, None)

    def apply(self, engine: int, batch: engine_pb2.KvEventBatch) -> None:
        """One batch of engine `engine`'s events. Device blocks are that engine's; kvstore blocks everyone's. Blocks
        of another group than ROUTING_GROUP are ignored."""
        bit = 1 << (engine + 1)
        for event in batch.events:
            kind = event.WhichOneof("event")
            if kind in ("stored", "removed") and getattr(event, kind).group_id != ROUTING_GROUP:
                continue
            if kind == "stored":
                stored = event.stored
                bits = STORE if stored.medium == "kvstore" else bit
                if stored.loaded_from == "kvstore":
                    bits |= STORE  # it was just loaded from there
                for block_hash in stored.block_hashes:
                    self._add(block_hash, bits)
            elif kind == "removed":  # the engine evicted them from its cache (the store's own evictions are silent)
                for block_hash in event.removed.block_hashes:
                    self._remove(block_hash, bit)
            elif kind == "cleared":
                self.drop_engine(engine)

    def drop_engine(self, engine: int) -> None:
        """Forget every block of this engine's cache (its KV event stream ended, or it cleared its cache)."""
        bit = 1 << (engine + 1)
        for block_hash in [h for h, mask in self.blocks.items() if mask & bit]:
            self._remove(block_hash, bit)

    def match(self, block_hashes: list[bytes]) -> list[tuple[int, int]]:
        """Per engine, (leading blocks in its cache, the leading blocks after those in the kvstore)."""
        masks = []
        for block_hash in block_hashes:
            mask = self.blocks.get(block_hash)
            if mask is None:
                break  # no engine and not the store: nothing past it can be reused
            self.blocks.move_to_end(block_hash)
            masks.append(mask)
        matches = []
        for engine in range(self.num_engines):
            bit = 1 << (engine + 1)
            local = next((i for i, mask in enumerate(masks) if not mask & bit), len(masks))
            store = next((i for i, mask in enumerate(masks[local:]) if not mask & STORE), len(masks) - local)
            matches.append((local, store))
        return matches


@dataclasses.dataclass
class Routed:
    """One request's place: its engine, and the blocks it was estimated to compute there."""

    address: str
    blocks: float
    prefilled: bool = False


class Router:
    def __init__(self, engines: list[str], policy: str = "prefix-aware", max_blocks: int = MAX_INDEX_BLOCKS):
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}.")
        self.engines = list(engines)
        self.policy = policy
        self.index = KVBlockIndex(len(self.engines), max_blocks)
        self.loads = {address: EngineLoad() for address in self.engines}
        self.turn = 0  # where the next tie (or round) starts
        self.block_size = 0  # 0 until set_model_info, or without prefix caching: nothing to match
        self.hash_fn = self.root = None

    def set_model_info(self, info: engine_pb2.ModelInfo) -> None:
        """Name blocks as the engines do (their ModelInfo)."""
        if not info.enable_prefix_caching or info.block_size <= 0:
            self.block_size = 0
            return
        self.hash_fn = get_hash_fn(info.prefix_caching_hash_algo)
        self.root = root_hash(self.hash_fn, info.prefix_caching_hash_seed or None)
        self.block_size = info.block_size

    def block_hashes(
        self, prompt_ids: list[int], cache_salt: str | None, lora_key: bytes | None = None, mm_features=()
    ) -> list[bytes]:
        """lora_key: the digest of the request's LoRA adapter, which the engines mix into its blocks' hashes, as they
        do the content hash of each image (mm_features: MultiModalInputs, whose identifier and mm_position are
        named as the engine's MultiModalFeatureSpec's) into the blocks its placeholders fall in."""
        if not self.block_size:
            return []
        return extend_block_hashes(
            [],
            prompt_ids,
            self.block_size,
            self.hash_fn,
            self.root,
            cache_salt or None,
            lora_key,
            mm_features=mm_features,
        )

    def engine_index(self, address: str) -> int:
        return self.engines.index(address)

    def _in_turn(self, healthy) -> list[str]:
        """The healthy engines, starting from this turn's."""
        order = self.engines[self.turn % len(self.engines) :] + self.engines[: self.turn % len(self.engines)]
        self.turn += 1
        return [address for address in order if address in healthy]

    def route(
        self,
        healthy,
        prompt_ids: list[int],
        cache_salt: str | None = None,
        lora_key: bytes | None = None,
        mm_features=(),
    ) -> Routed:
        """Choose an engine among the healthy ones and count the request there (release() when it ends)."""
        candidates = self._in_turn(healthy)
        if self.policy == "round-robin":
            chosen, blocks = candidates[0], 0.0
        elif self.policy == "least-loaded":
            chosen, blocks = min(candidates, key=lambda a: self.loads[a].num_in_flight), 0.0
        else:
            hashes = self.block_hashes(prompt_ids, cache_salt, lora_key, mm_features)
            matches = self.index.match(hashes)
            costs = {}
            for address in candidates:
                local, store = matches[self.engine_index(address)]
                costs[address] = engine_cost(len(hashes), local, store, self.loads[address])
            chosen = min(candidates, key=costs.__getitem__)
            local, store = matches[self.engine_index(chosen)]
            blocks = blocks_to_compute(local, store, len(hashes), self.loads[chosen])
        load = self.loads[chosen]
        load.num_prefilling += 1
        load.prefill_blocks += blocks
        return Routed(chosen, blocks)

    def first_token(self, routed: Routed) -> None:
        """The request's prefill is done: it decodes from now on."""
        if routed.prefilled:
            return
        routed.prefilled = True
        load = self.loads[routed.address]
        load.num_prefilling -= 1
        load.prefill_blocks = max(0.0, load.prefill_blocks - routed.blocks)
        load.num_decoding += 1

    def release(self, routed: Routed) -> None:
        """The request ended, however."""
        load = self.loads[routed.address]
        if routed.prefilled:
            load.num_decoding -= 1
        else:
            load.num_prefilling -= 1
            load.prefill_blocks = max(0.0, load.prefill_blocks - routed.blocks)

    def update_load(self, address: str, reply: engine_pb2.Load) -> None:
        load = self.loads[address]
        load.num_waiting = reply.num_waiting
        load.kv_cache_usage = reply.kv_cache_usage
        load.kv_load_cost = reply.kv_load_cost if reply.HasField("kv_load_cost") else None
