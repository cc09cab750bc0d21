"""SharedStorageConnector: KV blocks as files on a local disk, like vLLM's connector of that name.

Each full prompt block of each KV cache group is one file, {shared_storage_path}/{the group's fingerprint}/{block
hash in hex}: the block's raw bytes (the group's KVLayout's shape) and their CRC-32. Engines that share the directory
and the fingerprints share blocks. Everything runs in process: the scheduler side looks a request's blocks up once
(the longest prefix whose files every group needs exist), the worker side reads a load's blocks into the reserved
cache blocks before the forward (start_load_kv, reported done in the same step) and writes the step's new prompt
blocks that the request still holds after it (wait_for_save). A file that is missing, short or fails its checksum
ends its group's load there (a bad one is deleted); the load brings the prefix the groups still agree on, and the
rest of the prompt is recomputed.
"""

import logging
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from engine.kv.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVTransferConfig,
    LoadJob,
)
from engine.kv.connector.block_io import KVBlockIO
from engine.kv.layout import KVLayout
from engine.request import EngineCoreEventType

logger = logging.getLogger("llmmesh.engine.kv_connector")

CHECKSUM_BYTES = 4
# What it counts (SchedulerStats.kv_connector_stats): the scheduler side its lookups, the worker side the rest.
COUNTERS = (
    "lookups lookup_tokens lookup_hit_tokens loaded_tokens loaded_bytes load_failed_tokens "
    "stored_blocks stored_bytes store_failed_blocks"
).split()


def parse_extra_config(config: KVTransferConfig) -> Path:
    extra = config.kv_connector_extra_config
    unknown = set(extra) - {"shared_storage_path"}
    if unknown:
        raise ValueError(f"kv_connector_extra_config has unknown keys {sorted(unknown)}; allowed: shared_storage_path.")
    path = extra.get("shared_storage_path")
    if not isinstance(path, str) or not path:
        raise ValueError("kv_connector_extra_config.shared_storage_path must be a directory for the KV block files.")
    return Path(path)


@dataclass
class BlockJob:
    """Blocks of one KV cache group to store."""

    request_id: str
    group_id: int
    block_ids: list[int]
    block_hashes: list[bytes]


@dataclass
class SharedStorageConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[BlockJob] = field(default_factory=list)


class SharedStorageConnector(KVConnectorBase):
    medium = "shared_storage"

    def __init__(self, config: KVTransferConfig, role, layouts: list[KVLayout], kv_cache_manager=None):
        super().__init__(config, role, layouts, kv_cache_manager)  # either role: both halves' state is small
        self.root = parse_extra_config(config)
        try:
            for layout in layouts:
                (self.root / layout.fingerprint).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kv_connector_extra_config.shared_storage_path cannot hold files: {e}") from None
        self.stats = dict.fromkeys(COUNTERS, 0)
        # Scheduler side. request id -> (first block looked up, first block not on disk), until it is admitted.
        self.matches: dict[str, tuple[int, int]] = {}
        self.pending_loads: list[LoadJob] = []
        self.loading: dict[str, int] = {}  # request id -> first block of its load, until the worker reports it
        # request id -> leading blocks already on disk or being written
        self.num_stored_blocks: dict[str, int] = {}
        # Worker side.
        self.finished = KVConnectorOutput()

    def _path(self, group_id: int, block_hash: bytes) -> Path:
        return self.root / self.layouts[group_id].fingerprint / block_hash.hex()

    def _stored(self, group_id: int, block_hash: bytes) -> bool:
        """Whether the group's block is on disk: with tensor parallelism, every rank's shard of it."""
        return all((self.root / f / block_hash.hex()).exists() for f in self.layouts[group_id].all_fingerprints)

    # ---- scheduler side -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        bs = self.block_size
        first = num_computed_tokens // bs
        self.num_stored_blocks.setdefault(request.request_id, first)
        last = (request.num_tokens - 1) // bs  # the last prompt token always runs through the model
        match = self.matches.get(request.request_id)
        if match is None:
            if not self.config.is_kv_consumer or last <= first:
                return 0, False
            end = self.longest_hit(first, last, lambda g, i: self._stored(g, request.block_hashes[i]))
            match = self.matches[request.request_id] = (first, end)
            self.stats["lookups"] += 1
            self.stats["lookup_tokens"] += (last - first) * bs
            self.stats["lookup_hit_tokens"] += (end - first) * bs
        looked_from, end = match
        num_blocks = min(end, last) - first if first >= looked_from else 0
        return (num_blocks * bs, True) if num_blocks > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.matches.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        job = self.make_load_job(request, blocks, num_external_tokens)
        self.pending_loads.append(job)
        self.loading[request.request_id] = job.first
        self.num_stored_blocks[request.request_id] = job.end  # on disk already

    def build_connector_meta(self, scheduler_output) -> SharedStorageConnectorMetadata:
        meta = SharedStorageConnectorMetadata(loads=self.pending_loads)
        self.pending_loads = []
        if not self.config.is_kv_producer:
            return meta
        bs = self.block_size
        for request in scheduler_output.scheduled_requests:
            # The prompt blocks this step fills: written by the time wait_for_save reads them.
            num_tokens = request.num_computed_tokens + scheduler_output.num_scheduled_tokens[request.request_id]
            end = min(num_tokens, request.num_prompt_tokens, len(request.block_hashes) * bs) // bs
            start = self.num_stored_blocks.get(request.request_id, 0)
            if end <= start:
                continue
            for g, group in enumerate(self.kv_cache_manager.req_to_blocks[request.request_id]):
                held = self.held_blocks(group, start, end)
                ids, hashes = [group[i].block_id for i in held], [request.block_hashes[i] for i in held]
                meta.stores.append(BlockJob(request.request_id, g, ids, hashes))
            request.record_event(EngineCoreEventType.KV_STORE_STARTED, num_tokens=(end - start) * bs)
            self.num_stored_blocks[request.request_id] = end
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        for request_id, num_tokens in output.finished_recving.items():
            self.free_unloaded_blocks(request_id, self.loading.pop(request_id) + num_tokens // self.block_size)

    def request_finished(self, request) -> None:
        self.num_stored_blocks.pop(request.request_id, None)
        self.matches.pop(request.request_id, None)

    def has_pending_transfers(self) -> bool:
        return bool(self.loading)

    # ---- worker side ----------------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        self.block_ios = [KVBlockIO(kv_caches, layout) for layout in self.layouts]

    def _count(self, key: str, value: int) -> None:
        stats = self.finished.kv_connector_stats
        stats[key] = stats.get(key, 0) + value

    def start_load_kv(self, metadata: SharedStorageConnectorMetadata) -> None:
        """Read each group's blocks of each load up to its first missing or bad file, into the cache blocks reserved
        for them; the load brings the prefix the groups agree on."""
        bs = self.block_size
        for job in metadata.loads:
            loaded_bytes, num_loaded = 0, []
            for g, ids in enumerate(job.block_ids):
                blocks = []
                for block_hash in job.group_hashes(g):
                    data = self._read(g, block_hash)
                    if data is None:
                        break
                    blocks.append(data)
                if blocks:
                    self.block_ios[g].write(ids[: len(blocks)], b"".join(blocks))
                num_loaded.append(len(blocks))
                loaded_bytes += len(blocks) * self.layouts[g].block_bytes
            end = self.loaded_end(job, num_loaded)
            self.finished.finished_recving[job.request_id] = (end - job.first) * bs
            self._count("loaded_tokens", (end - job.first) * bs)
            self._count("loaded_bytes", loaded_bytes)
            self._count("load_failed_tokens", (job.end - end) * bs)

    def _read(self, group_id: int, block_hash: bytes) -> bytes | None:
        path = self._path(group_id, block_hash)
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        data, checksum = raw[:-CHECKSUM_BYTES], raw[-CHECKSUM_BYTES:]
        block_bytes = self.layouts[group_id].block_bytes
        if len(data) != block_bytes or zlib.crc32(data).to_bytes(CHECKSUM_BYTES, "little") != checksum:
            logger.warning("KV block file %s is damaged; deleted, its tokens are recomputed", path)
            path.unlink(missing_ok=True)
            return None
        return data

    def wait_for_save(self, metadata: SharedStorageConnectorMetadata) -> None:
        """Write the step's new blocks that are not on disk yet (each file appears whole or not at all)."""
        for job in metadata.stores:
            todo = [i for i, h in enumerate(job.block_hashes) if not self._path(job.group_id, h).exists()]
            if not todo:
                continue
            data = self.block_ios[job.group_id].read([job.block_ids[i] for i in todo])
            for i, block in zip(todo, data):
                path = self._path(job.group_id, job.block_hashes[i])
                partial = path.with_name(f".{path.name}.{os.getpid()}")  # renamed once whole
                try:
                    partial.write_bytes(block + zlib.crc32(block).to_bytes(CHECKSUM_BYTES, "little"))
                    os.replace(partial, path)
                except OSError as e:  # a full disk costs a later recomputation only
                    logger.warning("KV block file %s could not be written: %s", path, e)
                    partial.unlink(missing_ok=True)
                    self._count("store_failed_blocks", 1)
                    continue
                self._count("stored_blocks", 1)
                self._count("stored_bytes", len(block))

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        """Everything ran within the step: nothing to wait for."""
        done, self.finished = self.finished, KVConnectorOutput()
        return done
