"""KVStoreConnector: full KV blocks go to the kvstore service (Redis behind it) and come back from it.

Scheduler side. After the local prefix-cache hit, one Lookup per request and KV cache group asks the store
which further blocks it holds, and the longest prefix every group can serve is found by the local prefix cache's
rules (engine.kv.prefix_hit: a sliding-window group needs only its window's blocks before the end). It runs on a background thread (vLLM's asynchronous lookup): until its answer is
in, the scheduler leaves the request waiting and goes on with the others, so the engine thread never
waits on the network while there is work; a step with nothing to run waits for the answer (IDLE_WAIT_S at
most) in place of the worker's idle wait for transfers, so the request is admitted the step after it came.
If loading the blocks found is estimated to beat recomputing them, the request waits in
WAITING_FOR_REMOTE_KVS with blocks reserved while the worker loads into them. Each step, every block
the step fills (prompt blocks; decode blocks too with store_decode_blocks) that the request still holds becomes
a store job of its group, under that group's layout, and the connector holds a reference on the job's blocks until the worker has read them, so no block is reused
while a store still reads it.

Worker side. Loads and stores run on two background threads, never on the step's path (KVBlockIO
copies the blocks). A load offers the kvstore a shared-memory segment of shared_memory_bytes (made at the
first load, reused, its name unlinked once the kvstore has mapped it): a kvstore on this host writes the blocks
there and the load copies them into the cache from memory; one on another host declines and sends them as bytes.
Each block stored carries its tag (mesh/kvstore/block_tag.py), and a load takes blocks up to the first whose tag
fails. Any fault — the store down, slow past its deadline, or answering garbage — ends a transfer early: a load then
brings fewer blocks and the rest is recomputed; a store is dropped. After a fault the connector leaves the store
alone for retry_interval_s, then tries again. With kv_role kv_producer (a prefill engine), stores run on the step's
path instead: a step reports its tokens only once its blocks are in the store.
"""

import logging
import queue
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from engine.kv.block_pool import BlockStored
from engine.kv.connector.base import (
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorRole,
    KVConnectorStats,
    KVTransferConfig,
    LoadJob,
)
from engine.kv.connector.block_io import KVBlockIO
from engine.kv.layout import KVLayout
from engine.request import EngineCoreEventType
from mesh.kvstore.block_tag import BlockTagger, block_key_from_env
from mesh.kvstore.client import KVStoreClient, Staging

logger = logging.getLogger("llmmesh.engine.kv_connector")

LOAD_POLICIES = ("auto", "always", "never")
DEFAULTS = {
    "kvstore_address": None,
    "load_policy": "auto",  # auto: load only when the estimate says it beats recomputing
    "store_decode_blocks": False,
    "lookup_timeout_s": 0.5,
    "timeout_s": 10.0,  # per Get or Put call
    "retry_interval_s": 1.0,
    # A kvstore on this host writes loads into a segment of this size (whole blocks; 0: they come as bytes)
    "shared_memory_bytes": 128 * 2**20,
}
# Lookups in flight at once (each a thread blocked on its call).
LOOKUP_THREADS = 4
# The longest a step with nothing to run waits for a Lookup's answer (the worker's idle wait for transfers is as long).
IDLE_WAIT_S = 0.01


def parse_extra_config(config: KVTransferConfig) -> dict:
    extra = config.kv_connector_extra_config
    unknown = set(extra) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"kv_connector_extra_config has unknown keys {sorted(unknown)}; allowed: {sorted(DEFAULTS)}.")
    options = {**DEFAULTS, **extra}
    if not isinstance(options["kvstore_address"], str) or ":" not in options["kvstore_address"]:
        raise ValueError("kv_connector_extra_config.kvstore_address must be the kvstore's HOST:PORT.")
    if options["load_policy"] not in LOAD_POLICIES:
        raise ValueError(
            f"kv_connector_extra_config.load_policy must be one of {list(LOAD_POLICIES)}, got {options['load_policy']!r}."
        )
    for key in ("lookup_timeout_s", "timeout_s", "retry_interval_s"):
        if not isinstance(options[key], (int, float)) or not 0 < options[key] <= 3600:
            raise ValueError(f"kv_connector_extra_config.{key} must be a number of seconds in (0, 3600].")
    if not isinstance(options["shared_memory_bytes"], int) or not 0 <= options["shared_memory_bytes"] <= 2**40:
        raise ValueError("kv_connector_extra_config.shared_memory_bytes must be a number of bytes in [0, 2**40].")
    return options


@dataclass
class Lookup:
    """One request's Lookup: asked from first_block on; end_block once its answer is in (and counted)."""

    first_block: int
    future: Future  # (per group, whether each block from first_block is present; seconds), or None after a fault
    end_block: int | None = None  # the first block not to load


@dataclass
class StoreJob:
    job_id: int
    group_id: int  # the KV cache group whose blocks these are
    block_ids: list[int]
    block_hashes: list[bytes]
    trace_headers: tuple = ()


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    # The step runs nothing and the scheduler side waited for a Lookup's answer before it: the worker goes on at once.
    waited_for_lookup: bool = False


class LoadCostModel:
    """Load time (store latency + bytes / bandwidth) against recompute time (tokens / prefill rate).

    Both rates are measured as the engine runs (exponential averages); until a prefill has been measured,
    loading is assumed to pay (on a CPU it does by a wide margin; on a GPU the first measurement corrects it).
    """

    def __init__(self, block_bytes: int, block_size: int):
        self.block_bytes = block_bytes  # a prefix block's bytes in every KV cache group
        self.block_size = block_size
        self.latency_s = 0.005
        self.bandwidth = 200e6  # bytes/s, until measured
        self.prefill_rate: float | None = None  # tokens/s

    @staticmethod
    def _average(old: float | None, new: float, weight: float = 0.3) -> float:
        return new if old is None else (1 - weight) * old + weight * new

    def record_lookup(self, seconds: float) -> None:
        self.latency_s = self._average(self.latency_s, seconds)

    def record_load(self, nbytes: int, seconds: float) -> None:
        transfer = max(seconds - self.latency_s, 1e-6)
        self.bandwidth = self._average(self.bandwidth, nbytes / transfer)

    def record_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefill_rate = self._average(self.prefill_rate, num_tokens / seconds)

    def block_load_cost(self) -> float | None:
        """Loading one block (its bytes, the lookup's latency aside) over computing it; None until a prefill was
        measured. A router weighs blocks in the store by it."""
        if self.prefill_rate is None:
            return None
        return (self.block_bytes / self.bandwidth) / (self.block_size / self.prefill_rate)

    def load_pays(self, num_blocks: int) -> bool:
        if self.prefill_rate is None:
            return True
        load_s = self.latency_s + num_blocks * self.block_bytes / self.bandwidth
        return load_s < num_blocks * self.block_size / self.prefill_rate


class KVStoreConnector(KVConnectorBase):
    medium = "kvstore"

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, layouts: list[KVLayout], kv_cache_manager=None):
        super().__init__(config, role, layouts, kv_cache_manager)
        self.options = parse_extra_config(config)
        self.client = KVStoreClient(self.options["kvstore_address"], layouts)
        self.down_until = 0.0
        if role is KVConnectorRole.SCHEDULER:
            self.cost = LoadCostModel(sum(layout.block_bytes for layout in layouts), self.block_size)
            self.lookup_pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kv-lookup")
            self.lookups: dict[str, Lookup] = {}  # request id -> its Lookup, until the request is admitted
            self.next_job_id = 0
            self.load_jobs: dict[str, LoadJob] = {}  # request id -> its load, until the worker reports it
            self.pending_loads: list[LoadJob] = []  # to start next step
            self.store_holds: dict[int, tuple] = {}  # job id -> (blocks held, BlockStored event for when stored)
            self.last_stores: list[int] = []
            # request id -> leading blocks already stored, being stored, or known to be in the store
            self.num_stored_blocks: dict[str, int] = {}
            self.stats = {
                "lookups": 0,
                "lookup_tokens": 0,
                "lookup_hit_tokens": 0,
                "loaded_tokens": 0,
                "loaded_bytes": 0,
                "load_failed_tokens": 0,
                "stored_blocks": 0,
                "stored_bytes": 0,
                "store_failed_blocks": 0,
                "recompute_chosen_tokens": 0,
            }
        else:
            self.finished = KVConnectorOutput()
            self.finished_lock = threading.Condition()
            self.idle_wait = True  # False for a step before which the scheduler side waited already
            self.staging: Staging | None = None  # the load thread's, made at its first load
            self.staging_blocks = self.options["shared_memory_bytes"] // self.max_block_bytes
            self.tagger = BlockTagger(block_key_from_env())
            self.load_queue: queue.SimpleQueue = queue.SimpleQueue()
            self.store_queue: queue.SimpleQueue = queue.SimpleQueue()
            self.threads = [
                threading.Thread(target=self._run, args=(self.load_queue, self._load), name="kv-load", daemon=True),
                threading.Thread(target=self._run, args=(self.store_queue, self._store), name="kv-store", daemon=True),
            ]

    @property
    def max_block_bytes(self) -> int:
        return max(layout.block_bytes for layout in self.layouts)

    def register_kv_caches(self, kv_caches) -> None:
        self.block_ios = [KVBlockIO(kv_caches, layout) for layout in self.layouts]
        for t in self.threads:
            t.start()

    # ---- shared: a store that failed is left alone for a while ------------------------------------

    def _store_up(self) -> bool:
        return time.monotonic() >= self.down_until

    def _mark_down(self, what: str, error: Exception) -> None:
        if self._store_up():
            logger.warning(
                "kvstore at %s: %s failed (%s); recomputing, retrying in %.1f s",
                self.options["kvstore_address"],
                what,
                _describe(error),
                self.options["retry_interval_s"],
            )
        self.down_until = time.monotonic() + self.options["retry_interval_s"]

    # ---- scheduler side -----------------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        bs = self.block_size
        first = num_computed_tokens // bs
        # Local hits are in the store already, but a kv_producer hands every prompt over through it: its store job
        # checks them all, and writes those the store lost.
        self.num_stored_blocks.setdefault(request.request_id, 0 if self.config.kv_role == "kv_producer" else first)
        # The last prompt token always runs through the model.
        last = (request.num_tokens - 1) // bs
        # A prefill engine stored this prompt for this engine (vLLM's do_remote_prefill): load it, whatever the policy.
        remote_prefill = request.kv_transfer_params.get("do_remote_prefill", False)
        policy = "always" if remote_prefill else self.options["load_policy"]
        lookup = self.lookups.get(request.request_id)
        if lookup is None:
            if not self.config.is_kv_consumer or policy == "never" or last <= first:
                return 0, False
            if not self._store_up():
                return 0, False
            future = self.lookup_pool.submit(self._lookup, request.block_hashes[first:last], request.trace_headers)
            lookup = self.lookups[request.request_id] = Lookup(first, future)
        if lookup.end_block is None:
            if not lookup.future.done():
                return None, False
            lookup.end_block = self._take_answer(lookup, last, policy)
        # Local hits that grew while the request waited shorten the load; ones that shrank leave a gap: recompute.
        num_blocks = min(lookup.end_block, last) - first if first >= lookup.first_block else 0
        return (num_blocks * bs, True) if num_blocks > 0 else (0, False)

    def _lookup(self, block_hashes: list[bytes], trace_headers) -> tuple[list[list[bool]], float] | None:
        """On a lookup thread: per KV cache group, whether the store holds each of the blocks; and how long asking
        took."""
        started = time.perf_counter()
        try:
            timeout = self.options["lookup_timeout_s"]
            present = []
            for layout in self.layouts:
                # With tensor parallelism a block counts only if every rank's shard of it is there.
                answers = [
                    self.client.lookup(fingerprint, block_hashes, timeout, trace_headers)
                    for fingerprint in layout.all_fingerprints
                ]
                present.append([all(flags) for flags in zip(*answers)])
        except Exception as e:  # noqa: BLE001 (any failure of the store means: recompute)
            self._mark_down("lookup", e)
            return None
        return present, time.perf_counter() - started

    def _take_answer(self, lookup: Lookup, last: int, policy: str) -> int:
        """Count a finished Lookup (once per request) and decide: the first block not to load."""
        answer = lookup.future.result()
        if answer is None:
            return lookup.first_block
        present, seconds = answer
        first, bs = lookup.first_block, self.block_size
        num_present = self.longest_hit(first, last, lambda g, i: present[g][i - first]) - first
        self.cost.record_lookup(seconds)
        self.stats["lookups"] += 1
        self.stats["lookup_tokens"] += (last - lookup.first_block) * bs
        self.stats["lookup_hit_tokens"] += num_present * bs
        if num_present and policy == "auto" and not self.cost.load_pays(num_present):
            self.stats["recompute_chosen_tokens"] += num_present * bs
            return lookup.first_block
        return lookup.first_block + num_present

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.lookups.pop(request.request_id, None)
        if num_external_tokens == 0:
            return
        job = self.make_load_job(request, blocks, num_external_tokens)
        self.pending_loads.append(job)
        self.load_jobs[request.request_id] = job
        # What comes from the store need not go back to it.
        self.num_stored_blocks[request.request_id] = job.end

    def _new_job_id(self) -> int:
        self.next_job_id += 1
        return self.next_job_id

    def build_connector_meta(self, scheduler_output) -> KVStoreConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self.pending_loads)
        self.pending_loads = []
        if self.config.is_kv_producer and self._store_up():
            for request in scheduler_output.scheduled_requests:
                self._schedule_store(request, scheduler_output.num_scheduled_tokens[request.request_id], meta)
        self.last_stores = [job.job_id for job in meta.stores]
        if scheduler_output.is_empty and not meta.loads:
            meta.waited_for_lookup = self._wait_for_lookup()
        return meta

    def _wait_for_lookup(self) -> bool:
        """A step with nothing to run: wait for the first Lookup in flight to answer (IDLE_WAIT_S at most), so the
        request it is for is admitted in the next step rather than after a fixed idle wait; False when none is."""
        in_flight = [lookup.future for lookup in self.lookups.values() if not lookup.future.done()]
        if in_flight:
            wait(in_flight, timeout=IDLE_WAIT_S, return_when=FIRST_COMPLETED)
        return bool(in_flight)

    def _schedule_store(self, request, num_new_tokens: int, meta: KVStoreConnectorMetadata) -> None:
        """Store the blocks this step fills (they are written by the time the worker reads them)."""
        bs = self.block_size
        limit = request.num_tokens if self.options["store_decode_blocks"] else request.num_prompt_tokens
        end = min(request.num_computed_tokens + num_new_tokens, limit, len(request.block_hashes) * bs) // bs
        start = self.num_stored_blocks.get(request.request_id, 0)
        if end <= start:
            return
        for g, group in enumerate(self.kv_cache_manager.req_to_blocks[request.request_id]):
            held = self.held_blocks(group, start, end)
            if not held:
                continue
            blocks, hashes = [group[i] for i in held], [request.block_hashes[i] for i in held]
            self.kv_cache_manager.block_pool.touch(blocks)
            job = StoreJob(self._new_job_id(), g, [b.block_id for b in blocks], hashes, request.trace_headers)
            event = BlockStored(
                block_hashes=hashes,
                parent_block_hash=request.block_hashes[held[0] - 1] if held[0] else None,
                token_ids=request.all_token_ids[held[0] * bs : end * bs],
                block_size=bs,
                medium="kvstore",
                group_id=g,
            )
            self.store_holds[job.job_id] = (blocks, event)
            meta.stores.append(job)
        request.record_event(EngineCoreEventType.KV_STORE_STARTED, num_tokens=(end - start) * bs)
        self.num_stored_blocks[request.request_id] = end

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        super().update_connector_output(output)
        pool = self.kv_cache_manager.block_pool
        for job_id, stored in output.finished_sending.items():
            hold = self.store_holds.pop(job_id, None)
            if hold is None:  # abandoned after a failed step
                continue
            blocks, event = hold
            pool.free_blocks(blocks)
            self.stats["stored_blocks" if stored else "store_failed_blocks"] += len(blocks)
            if stored:
                self.stats["stored_bytes"] += len(blocks) * self.layouts[event.group_id].block_bytes
                pool.record_event(event)
        for request_id, num_tokens in output.finished_recving.items():
            job = self.load_jobs.pop(request_id)
            self.free_unloaded_blocks(request_id, job.first + num_tokens // self.block_size)
            self.stats["loaded_tokens"] += num_tokens
            self.stats["load_failed_tokens"] += (job.end - job.first) * self.block_size - num_tokens
        for nbytes, seconds in output.load_timings:
            self.stats["loaded_bytes"] += nbytes
            self.cost.record_load(nbytes, seconds)

    def abandon_stores(self) -> None:
        """The last step failed: its blocks were never written, so its stores must not run."""
        for job_id in self.last_stores:
            hold = self.store_holds.pop(job_id, None)
            if hold is not None:
                self.kv_cache_manager.block_pool.free_blocks(hold[0])
        self.last_stores = []

    def request_finished(self, request) -> None:
        self.num_stored_blocks.pop(request.request_id, None)
        self.lookups.pop(request.request_id, None)

    def has_pending_transfers(self) -> bool:
        return bool(self.load_jobs or self.store_holds)

    def get_kv_connector_stats(self) -> KVConnectorStats:
        stats = super().get_kv_connector_stats()
        stats.block_load_cost = self.cost.block_load_cost()
        return stats

    def record_step_time(self, scheduler_output, seconds: float) -> None:
        """Prefill speed for the load-or-recompute estimate, from steps that are mostly prefill."""
        so = scheduler_output
        prefill = sum(n for n in so.num_scheduled_tokens.values() if n > 1)
        if prefill >= self.block_size and prefill * 2 >= so.total_num_scheduled_tokens:
            self.cost.record_prefill(so.total_num_scheduled_tokens, seconds)

    # ---- worker side ----------------------------------------------------------------------------------

    def start_load_kv(self, metadata: KVStoreConnectorMetadata) -> None:
        self.idle_wait = not metadata.waited_for_lookup
        for job in metadata.loads:
            self.load_queue.put(job)

    def wait_for_save(self, metadata: KVStoreConnectorMetadata) -> None:
        # A kv_producer's step answers only once its blocks are in the store: the kv_consumer it hands the
        # request to looks them up next (vLLM's disaggregated prefill).
        if self.config.kv_role == "kv_producer":
            for job in metadata.stores:
                self._store(job)
            return
        for job in metadata.stores:
            self.store_queue.put(job)

    def get_finished(self, wait_s: float = 0.0) -> KVConnectorOutput:
        with self.finished_lock:
            if wait_s > 0 and self.idle_wait and self.finished.is_empty():
                self.finished_lock.wait(wait_s)
            done, self.finished = self.finished, KVConnectorOutput()
        return done

    def _run(self, jobs: queue.SimpleQueue, work) -> None:
        while (job := jobs.get()) is not None:
            work(job)

    def _load(self, job: LoadJob) -> None:
        """Each group's blocks in turn; the load brings the prefix the groups agree on in what arrived."""
        started, num_loaded = time.perf_counter(), [0] * len(self.layouts)
        if self._store_up():
            try:
                for g in range(len(self.layouts)):
                    num_loaded[g] = self._load_group(job, g)
            except Exception as e:  # noqa: BLE001 (what arrived before the fault is good; the rest is recomputed)
                self._drop_staging()  # the Get that failed may still be writing into it
                self._mark_down("load", e)
        seconds = time.perf_counter() - started
        nbytes = sum(n * layout.block_bytes for n, layout in zip(num_loaded, self.layouts))
        with self.finished_lock:
            self.finished.finished_recving[job.request_id] = (
                self.loaded_end(job, num_loaded) - job.first
            ) * self.block_size
            if nbytes:
                self.finished.load_timings.append((nbytes, seconds))
            self.finished_lock.notify_all()

    def _load_group(self, job: LoadJob, group_id: int) -> int:
        """Load one group's blocks of the job, up to the first the store lacks: how many arrived."""
        layout, block_io = self.layouts[group_id], self.block_ios[group_id]
        hashes, ids = job.group_hashes(group_id), job.block_ids[group_id]
        loaded, total = 0, len(hashes)
        while loaded < total:
            staging = self._staging()
            end = total if staging is None else min(total, loaded + staging.num_blocks)
            asked = loaded
            blocks = self.client.get(layout, hashes[loaded:end], self.options["timeout_s"], job.trace_headers, staging)
            for data, tags in blocks:
                num_blocks = len(data) // layout.block_bytes
                good = self.tagger.verified(
                    layout.fingerprint, hashes[loaded : loaded + num_blocks], data, tags, layout.block_bytes
                )
                block_io.write(ids[loaded : loaded + good], data[: good * layout.block_bytes])
                loaded += good
                if good < num_blocks:
                    logger.warning(
                        "a KV block from the store fails its tag (not written by an engine with this mesh's block "
                        "key): it and the blocks after it are recomputed"
                    )
                    blocks.close()  # ends the Get
                    self._drop_staging()  # which may still be writing into it
                    return loaded
            if staging is not None:
                self._after_get(staging, loaded > asked)
            if loaded < end:
                break  # the store holds no more of them
        return loaded

    def _staging(self) -> Staging | None:
        """The segment loads go through, made at the first load that wants it; None for loads that come as bytes."""
        if self.staging is None and self.staging_blocks:
            try:
                self.staging = Staging(self.staging_blocks, self.max_block_bytes)
            except OSError as e:
                logger.warning("no shared memory for the kvstore's loads (%s): they come as bytes", e)
                self.staging_blocks = 0
        return self.staging

    def _after_get(self, staging: Staging, got_blocks: bool) -> None:
        if staging.taken:
            staging.unlink()  # the kvstore has it mapped: nothing else may open it
        elif got_blocks:  # the blocks came as bytes
            if staging.linked:  # never mapped: the kvstore cannot map this host's memory
                logger.info("the kvstore at %s cannot map this host's memory: loads come as bytes", self.client.address)
                self.staging_blocks = 0
            # Otherwise the kvstore let it go (a restart, or newer segments): the next load offers another.
            self._drop_staging()

    def _drop_staging(self) -> None:
        if self.staging is not None:
            self.staging.close()
            self.staging = None

    def _store(self, job: StoreJob) -> None:
        stored = False
        if self._store_up():
            try:
                layout, timeout = self.layouts[job.group_id], self.options["timeout_s"]
                present = self.client.lookup(layout.fingerprint, job.block_hashes, timeout, job.trace_headers)
                todo = [i for i, found in enumerate(present) if not found]
                if todo:
                    data = self.block_ios[job.group_id].read([job.block_ids[i] for i in todo])
                    hashes = [job.block_hashes[i] for i in todo]
                    tags = [self.tagger.tag(layout.fingerprint, h, d) for h, d in zip(hashes, data)]
                    self.client.put(layout, zip(hashes, data, tags), timeout, job.trace_headers)
                stored = True
            except Exception as e:  # noqa: BLE001 (a lost store costs a later recomputation only)
                self._mark_down("store", e)
        with self.finished_lock:
            self.finished.finished_sending[job.job_id] = stored
            self.finished_lock.notify_all()

    def shutdown(self) -> None:
        if self.role is KVConnectorRole.SCHEDULER:
            self.lookup_pool.shutdown(wait=False, cancel_futures=True)
        else:
            for q in (self.load_queue, self.store_queue):
                q.put(None)
            for t in self.threads:
                if t.is_alive():
                    t.join(timeout=self.options["timeout_s"])
            self._drop_staging()
        self.client.close()


def _describe(error: Exception) -> str:
    code = getattr(error, "code", None)
    if callable(code):
        return f"{code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
