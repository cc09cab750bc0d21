"""The KV connector interface (vLLM's KVConnectorBase_V1) and its configuration (KVTransferConfig).

A connector moves KV blocks between the engine's paged cache and somewhere else. It has two halves,
one per role, as in vLLM: the scheduler side decides (how many prompt tokens can come from outside,
which blocks to store) and says so in a KVConnectorMetadata attached to each step; the worker side
does the copying (start_load_kv before the forward, wait_for_save after it) and reports what finished
(get_finished) in the step's KVConnectorOutput. This file is the whole interface: the engine core
builds the scheduler half, the worker builds its own, and neither they nor the scheduler know which
connector they run. Torch-free: the engine's config imports it.

A model whose layers form several KV cache groups (engine.kv.kv_cache_spec) has one KVLayout per group, and a
request one block list per group: a connector moves each group's blocks under that group's layout, and finds the
prefix every group agrees on by the local prefix cache's rules (engine.kv.prefix_hit).
"""

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.json_object import parse_json_object
from engine.kv.layout import KVLayout
from engine.kv.prefix_hit import longest_common_hit, needed_blocks

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
CONFIG_KEYS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_connector_module_path")


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class KVTransferConfig:
    """vLLM's --kv-transfer-config: which connector, which role, and the connector's own options.

    kv_connector names a connector the factory knows, or a class in the module kv_connector_module_path
    (vLLM's way to plug in a connector that lives outside the engine)."""

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    kv_connector_module_path: str | None = None

    @classmethod
    def from_json(cls, text: str) -> "KVTransferConfig":
        data = parse_json_object(text, "kv_transfer_config", CONFIG_KEYS)
        if "kv_connector" not in data:
            raise ValueError("kv_transfer_config.kv_connector is required.")
        config = cls(**data)
        from engine.kv.connector.factory import CONNECTORS  # here: the registry imports this file

        module_path = config.kv_connector_module_path
        if module_path is not None and (not isinstance(module_path, str) or not module_path):
            raise ValueError("kv_connector_module_path must be a module's dotted path, e.g. 'mypackage.connector'.")
        if config.kv_connector not in CONNECTORS and module_path is None:
            raise ValueError(
                f"kv_connector must be one of {sorted(CONNECTORS)}, or a class in the module "
                f"kv_connector_module_path names; got {config.kv_connector!r}."
            )
        if module_path is None:
            # A registered name resolves to its module here, so the config means the same in a process that
            # registered nothing (a tensor-parallel rank).
            config.kv_connector_module_path = CONNECTORS[config.kv_connector].split(":")[0]
        if config.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {list(KV_ROLES)}, got {config.kv_role!r}.")
        if not isinstance(config.kv_connector_extra_config, dict):
            raise ValueError("kv_connector_extra_config must be a JSON object.")
        return config

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step; each connector defines its own."""


@dataclass
class KVConnectorOutput:
    """What the worker side reports after a step: transfers that finished since the last report."""

    # request id -> tokens its load brought (a multiple of the block size; fewer than asked after a fault): the
    # scheduler then queues the request again to compute the rest
    finished_recving: dict[str, int] = field(default_factory=dict)
    # store job id -> whether its blocks reached the store; either way the worker no longer reads them
    finished_sending: dict[int, bool] = field(default_factory=dict)
    # (bytes, seconds) of each finished load, for a load-or-recompute estimate
    load_timings: list[tuple[int, float]] = field(default_factory=list)
    # counters the worker side counted since its last report; the scheduler side adds them to its stats
    kv_connector_stats: dict[str, int] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.finished_recving or self.finished_sending)


@dataclass
class KVConnectorStats:
    """A connector's figures (vLLM's KVConnectorStats): `data`, its cumulative counters by name (tokens, blocks,
    bytes), exported on /metrics (SchedulerStats.kv_connector_stats); and, for a connector that weighs loading
    against recomputing, what loading a block costs over computing it (None until it knows)."""

    data: dict[str, int] = field(default_factory=dict)
    block_load_cost: float | None = None


@dataclass
class LoadJob:
    """A request's blocks [first, end) to load, each group's last len(block_ids[g]) of them: a sliding-window group
    needs only those of its window before the end (engine.kv.prefix_hit)."""

    request_id: str
    first: int
    block_hashes: list[bytes]  # of blocks [first, end)
    block_ids: list[list[int]]  # per group, the cache blocks they go into
    trace_headers: tuple = ()  # the request's (Request.trace_headers): a remote store's calls join its trace

    @property
    def end(self) -> int:
        return self.first + len(self.block_hashes)

    def group_hashes(self, group_id: int) -> list[bytes]:
        return self.block_hashes[len(self.block_hashes) - len(self.block_ids[group_id]) :]

    def loaded(self, group_id: int, num_blocks: int) -> range:
        """The blocks a group brought, its first num_blocks."""
        start = self.end - len(self.block_ids[group_id])
        return range(start, start + num_blocks)


class KVConnectorBase:
    """Both roles' methods; an instance serves one role.

    layouts: what a block of each KV cache group is outside the paged cache (the worker's Worker.kv_layouts).
    kv_cache_manager: the scheduler side's KVCacheManager (None on the worker side), for a connector that holds
    blocks past the step that fills them.
    """

    # Where this connector keeps blocks, as KV events name it (BlockStored.loaded_from of blocks it loaded).
    medium = "external"

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layouts: list[KVLayout], kv_cache_manager=None):
        self.config = config
        self.role = role
        self.layouts = list(layouts)
        self.block_size = layouts[0].block_size
        self.specs = [layout.kv_cache_spec for layout in layouts]
        self.kv_cache_manager = kv_cache_manager
        # Cumulative counters by name (tokens, blocks, bytes): SchedulerStats.kv_connector_stats, exported on
        # /metrics (lookup_tokens, lookup_hit_tokens, loaded_bytes and stored_bytes under vLLM's names).
        self.stats: dict[str, int] = {}

    # ---- groups: the same rules as the local prefix cache ------------------------------------------

    def longest_hit(self, first: int, last: int, is_stored: Callable[[int, int], bool]) -> int:
        """The first block past the longest prefix every group can serve, with blocks [0, first) hits already (the
        local prefix cache's) and is_stored(group, block) for the others, at most `last`."""
        return longest_common_hit(self.specs, self.block_size, lambda g, i: i < first or is_stored(g, i), last)

    def blocks_to_load(self, group_id: int, first: int, end: int) -> range:
        """The blocks of [first, end) that a hit ending at `end` needs in this group (a sliding window's last ones)."""
        needed = needed_blocks(self.specs[group_id], self.block_size, end)
        return range(max(first, needed.start), end)

    def make_load_job(self, request, blocks, num_external_tokens: int) -> LoadJob:
        """The load of num_external_tokens after the request's computed ones into its blocks (one list per group)."""
        first = request.num_computed_tokens // self.block_size
        end = first + num_external_tokens // self.block_size
        ids = [[group[i].block_id for i in self.blocks_to_load(g, first, end)] for g, group in enumerate(blocks)]
        return LoadJob(request.request_id, first, request.block_hashes[first:end], ids, request.trace_headers)

    def loaded_end(self, job: LoadJob, num_loaded: list[int]) -> int:
        """Where a load that brought each group's first num_loaded[g] blocks ends: the prefix the groups agree on."""
        return self.longest_hit(job.first, job.end, lambda g, i: i in job.loaded(g, num_loaded[g]))

    def free_unloaded_blocks(self, request_id: str, end: int) -> None:
        """A load ended at block `end`: a sliding group's blocks before its window were reserved but never loaded;
        they go back to the pool (the null block in their place) before the loaded blocks join the prefix cache."""
        manager = self.kv_cache_manager
        for group_manager, blocks in zip(manager.managers, manager.req_to_blocks.get(request_id, ())):
            group_manager.remove_skipped_blocks(blocks, end * self.block_size)

    def held_blocks(self, group_blocks, start: int, end: int) -> list[int]:
        """The blocks of [start, end) a request still holds in one group (a sliding window's freed ones are the null
        block, and are not stored)."""
        null = self.kv_cache_manager.block_pool.null_block
        return [i for i in range(start, min(end, len(group_blocks))) if group_blocks[i] is not null]

    # ---- scheduler side ------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the num_computed_tokens of the local prefix hit that this connector can provide, and
        whether they load asynchronously: the request then waits in WAITING_FOR_REMOTE_KVS while they load (this
        engine uses external tokens only so). None tokens: the answer is not in yet; the scheduler skips the
        request this step and asks again on a later one. A waiting request is tried on every step until it is
        admitted: answer from one look-up per request."""
        raise NotImplementedError

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """The request is admitted with blocks (one list per KV cache group) reserved for num_external_tokens (0:
        nothing to load); remember what to load into them."""
        raise NotImplementedError

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        """This step's loads and stores; resets the connector's per-step state."""
        raise NotImplementedError

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The worker's report for a step: counts what it counted; a connector adds its own bookkeeping."""
        for key, value in output.kv_connector_stats.items():
            self.stats[key] = self.stats.get(key, 0) + value

    def record_step_time(self, scheduler_output, seconds: float) -> None:
        """How long the worker took to run a step (its forward pass), for estimates such as load or recompute."""

    def abandon_stores(self) -> None:
        """The last step failed before its blocks were written: drop its stores."""

    def request_finished(self, request) -> None:
        """A request ended (finished or aborted): drop what is kept for it."""

    def has_pending_transfers(self) -> bool:
        """Whether a transfer still holds blocks or a request: the engine steps until it ends."""
        return False

    def get_kv_connector_stats(self) -> KVConnectorStats:
        """The figures so far, a copy the caller may keep."""
        return KVConnectorStats(dict(self.stats))

    # ---- worker side ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        """The worker's paged KV cache: per model layer, its (K, V) tensors (layers of different groups may share
        tensors: a block id belongs to one group at a time)."""

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        """Begin this step's loads."""
        raise NotImplementedError

    def wait_for_save(self, metadata: KVConnectorMetadata) -> None:
        """After the forward: this step's stores."""
        raise NotImplementedError

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        """Transfers that finished since the last call; waits up to wait_s for one when none has."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
