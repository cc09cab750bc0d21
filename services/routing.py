"""Which engine replica a request goes to: KV-cache-aware routing over the engines' KV events.

Each engine streams its KV cache events (llmmesh.v1.Engine/SubscribeKvEvents: BlockStored, BlockRemoved,
AllBlocksCleared, with their medium). KVBlockIndex keeps from them which engines hold which block hash in their
paged cache, and which hashes are in the kvstore they share. The Router names a prompt's full blocks exactly as the
engines do (engine/kv/hashing.py, with the algorithm, seed and block size from their ModelInfo, and the request's
cache_salt), matches them against the index, and picks by one policy (--routing):

- prefix-aware: the lowest engine_cost (below): the blocks it would still compute, plus the work already there;
- least-loaded: the fewest requests in flight from this gateway;
- round-robin: each healthy engine in turn.

Equal costs go to the engine holding more of the prompt, then to the engines in turn. The router indexes the blocks of each prompt it sends under the engine it chose at
once: that engine holds them (computed or loaded) by the time its prefill ends, while the engine's own BlockStored
events come a step or more later, after the next turn of a conversation may already have been routed. The index is
a hint, never trusted for output: an event lost, late or duplicated, or an engine restarted, at worst sends a
request where its prefix is not, and that engine computes it (a cache miss). A new event stream starts from
nothing, AllBlocksCleared empties an engine's entries, and an unhealthy engine's entries are dropped.

A model whose layers form several KV cache groups caches each prefix block once per group under the same hash, and
its events name the group. The index keeps ROUTING_GROUP's alone (another group's eviction of a hash would drop it):
groups are numbered full attention first, so that is a full-attention group whenever the model has one, and its
leading run of blocks is the prefix the engine hits (a sliding group needs fewer). With only sliding-window groups
it is a sliding group: a leading run of its blocks is still a hit (it holds the window before its end), so the index
never credits an engine with a prefix it lacks; it misses a hit whose first blocks the engine has already evicted. The index holds at most max_blocks hashes (MAX_INDEX_BLOCKS), each within INDEX_ENTRY_BYTES, so
32 MiB at most; past it, the least recently stored or matched hash is forgotten.

With a decision log (--routing-log), every choice is written as one JSON line: the engine chosen, and per engine
the prompt's blocks it holds, those after them in the kvstore, its cost and the load it was weighed with.
"""

import collections
import dataclasses
import json
import logging
import time

from engine.kv.hashing import extend_block_hashes, get_hash_fn, root_hash
from llmmesh.v1 import engine_pb2

logger = logging.getLogger("llmmesh.gateway")

ROUTING_POLICIES = ("prefix-aware", "least-loaded", "round-robin")
MAX_INDEX_BLOCKS = 1 << 17  # hashes in the index: 2M tokens of 16-token blocks across every engine and the store
INDEX_ENTRY_BYTES = 256  # one entry: its 32-byte hash as a bytes object and its slot in the ordered dict
DEFAULT_KV_LOAD_COST = 0.5  # loading a block over computing it, until an engine has measured both
DECODE_COST_BLOCKS = 1.0  # a request decoding on an engine lengthens its steps about as much as a block of prefill
# A load from the kvstore waits for its transfer's round trip beyond the blocks' bytes that kv_load_cost weighs: on a
# 2-core CPU about what prefilling 1-2 blocks takes, so a turn is not sent from its holder for a near tie.
STORE_LOAD_TRIP_BLOCKS = 2.0
KV_USAGE_SOFT_LIMIT = 0.9  # past it an engine evicts cached prefixes and may preempt
STORE = 1  # the index's bit for "in the kvstore"; engine i has bit 1 << (i + 1)
ROUTING_GROUP = 0  # the KV cache group whose blocks the index keeps (see above)


@dataclasses.dataclass
class EngineLoad:
    """What the router knows of one engine's load: its own requests there (fresh, exact), and what GetLoad adds
    (polled): the requests there from other clients, its KV usage and its measured load cost."""

    num_prefilling: int = 0  # requests sent there that have no first token yet
    prefill_blocks: float = 0.0  # the blocks those still compute, as estimated when they were sent
    num_decoding: int = 0  # requests sent there past their first token
    others_waiting: int = 0  # GetLoad: requests in its waiting queue beyond this gateway's own
    others_running: int = 0  # GetLoad: requests running there beyond this gateway's own
    kv_cache_usage: float = 0.0  # GetLoad: 0..1
    kv_load_cost: float | None = None  # GetLoad: measured time to load a block from the kvstore over computing it

    @property
    def num_in_flight(self) -> int:
        return self.num_prefilling + self.num_decoding


def blocks_to_compute(local_blocks: int, store_blocks: int, num_blocks: int, load_cost: float) -> float:
    """The prompt's full blocks an engine would still have to compute, a block from the kvstore counted at the load
    cost (a fraction of computing it)."""
    return num_blocks - local_blocks - store_blocks * (1.0 - load_cost)


def engine_cost(num_blocks: int, local_blocks: int, store_blocks: int, load: EngineLoad, load_cost: float) -> float:
    """The prefix-aware policy: what sending a prompt of num_blocks full blocks to this engine costs, in blocks of
    prefill; the lowest cost wins.

    - the blocks it would compute: the prompt's leading blocks in its own cache (local_blocks) count in full, the
      next leading ones in the kvstore (store_blocks) at load_cost, one figure for every engine (the store is as
      near to each), so that blocks in the store are what any engine has, never a reason to pick one; loading any
      adds STORE_LOAD_TRIP_BLOCKS, the transfer's round trip (the request waits for it; the engine's steps do not);
    - the work already there, which runs in the same steps: the blocks still to prefill of the requests this
      gateway sent there, DECODE_COST_BLOCKS per request decoding there, and per request of another client
      waiting in its queue (GetLoad) one more prompt like this one. The gateway's own requests are counted once,
      from what it sent: a polled queue length is up to a health interval old, and counts them again;
    - its KV usage (GetLoad): past KV_USAGE_SOFT_LIMIT, up to the whole prompt again at a full cache, where it
      would evict the prefixes it holds and preempt.
    """
    own = blocks_to_compute(local_blocks, store_blocks, num_blocks, load_cost)
    if store_blocks:
        own += STORE_LOAD_TRIP_BLOCKS
    queued = load.prefill_blocks + num_blocks * load.others_waiting
    decoding = DECODE_COST_BLOCKS * (load.num_decoding + load.others_running)
    pressure = max(0.0, load.kv_cache_usage - KV_USAGE_SOFT_LIMIT) / (1.0 - KV_USAGE_SOFT_LIMIT)
    return own + queued + decoding + pressure * num_blocks


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

    def add_sent(self, engine: int, block_hashes: list[bytes]) -> None:
        """A prompt's blocks, sent to this engine: it holds them once its prefill ends (its events confirm it)."""
        bit = 1 << (engine + 1)
        for block_hash in block_hashes:
            self._add(block_hash, bit)

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
    def __init__(
        self, engines: list[str], policy: str = "prefix-aware", max_blocks: int = MAX_INDEX_BLOCKS, decision_log=None
    ):
        """decision_log: a text file each decision is written to as a JSON line (see above); None: none."""
        if policy not in ROUTING_POLICIES:
            raise ValueError(f"routing must be one of {', '.join(ROUTING_POLICIES)}, got {policy!r}.")
        self.engines = list(engines)
        self.policy = policy
        self.index = KVBlockIndex(len(self.engines), max_blocks)
        self.loads = {address: EngineLoad() for address in self.engines}
        self.turn = 0  # where the next tie (or round) starts
        self.block_size = 0  # 0 until set_model_info, or without prefix caching: nothing to match
        self.hash_fn = self.root = None
        self.decision_log = decision_log
        self.event_lag = {address: 0.0 for address in self.engines}  # s from an engine's last event batch to here

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

    def apply_events(self, address: str, batch: engine_pb2.KvEventBatch) -> None:
        """One batch of an engine's KV events into the index; its lag is noted for the decision log."""
        self.index.apply(self.engine_index(address), batch)
        if batch.sequence_number and batch.timestamp:  # not the snapshot a stream opens with
            self.event_lag[address] = time.time() - batch.timestamp

    def kv_load_cost(self) -> float:
        """Loading a block from the kvstore over computing it: the mean of the engines' measurements. One figure
        for every engine, so that a block in the store weighs the same wherever the request goes."""
        measured = [
            min(max(load.kv_load_cost, 0.0), 1.0) for load in self.loads.values() if load.kv_load_cost is not None
        ]
        return sum(measured) / len(measured) if measured else DEFAULT_KV_LOAD_COST

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
        weigh = self.policy == "prefix-aware" or self.decision_log is not None
        hashes = self.block_hashes(prompt_ids, cache_salt, lora_key, mm_features) if weigh else []
        matches = self.index.match(hashes) if weigh else []
        load_cost = self.kv_load_cost()
        costs = {}
        for address in candidates if weigh else ():
            local, store = matches[self.engine_index(address)]
            costs[address] = engine_cost(len(hashes), local, store, self.loads[address], load_cost)
        if self.policy == "round-robin":
            chosen = candidates[0]
        elif self.policy == "least-loaded":
            chosen = min(candidates, key=lambda a: self.loads[a].num_in_flight)
        else:  # on equal costs, the engine holding more of the prompt: the next turn finds it there too
            chosen = min(candidates, key=lambda a: (costs[a], -matches[self.engine_index(a)][0]))
        blocks = 0.0
        if hashes:
            local, store = matches[self.engine_index(chosen)]
            blocks = blocks_to_compute(local, store, len(hashes), load_cost)
            self.index.add_sent(self.engine_index(chosen), hashes)
        if self.decision_log is not None:
            self._log(chosen, len(hashes), candidates, matches, costs, load_cost)
        load = self.loads[chosen]
        load.num_prefilling += 1
        load.prefill_blocks += blocks
        return Routed(chosen, blocks)

    def _log(self, chosen: str, num_blocks: int, candidates, matches, costs, load_cost: float) -> None:
        """One decision as a JSON line: the loads it was weighed with, before this request is counted."""
        engines = {}
        for address in candidates:
            load = self.loads[address]
            local, store = matches[self.engine_index(address)]
            engines[address] = {
                "local_blocks": local,
                "store_blocks": store,
                "cost": round(costs[address], 3),
                **{k: round(v, 3) if isinstance(v, float) else v for k, v in dataclasses.asdict(load).items()},
                "event_lag_ms": round(self.event_lag[address] * 1e3, 1),
            }
        record = {"time": time.time(), "policy": self.policy, "engine": chosen, "blocks": num_blocks}
        record.update(kv_load_cost=round(load_cost, 4), engines=engines)
        self.decision_log.write(json.dumps(record) + "\n")
        self.decision_log.flush()

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
        """GetLoad's answer. Its queue lengths count this gateway's requests too, which the router already knows
        exactly: only what is there beyond them (other clients' requests) is kept. Ours that the engine has not yet
        seen, or already finished, make that an underestimate, never a double count."""
        load = self.loads[address]
        load.others_waiting = max(0, reply.num_waiting - load.num_prefilling)
        others = max(0, reply.num_waiting + reply.num_running - load.num_in_flight)
        load.others_running = max(0, others - load.others_waiting)
        load.kv_cache_usage = reply.kv_cache_usage
        load.kv_load_cost = reply.kv_load_cost if reply.HasField("kv_load_cost") else None
