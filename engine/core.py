"""EngineCore: the scheduler and the KV cache manager, advanced one step at a time by an executor (one Worker in
this process, or one per rank).

With pipeline parallelism (P stages) a step is vLLM's step_with_batch_queue: it schedules a batch and hands it to the
ranks while up to P - 1 earlier ones are still in the pipeline, and takes the oldest batch's output once P are in
flight (or nothing new could be scheduled), so every stage has a batch to work on. Outputs are taken in the order
the batches were scheduled."""

import logging
import time
from collections import deque
from dataclasses import dataclass, fields, replace
from functools import partial
from types import MappingProxyType

from engine.config import EngineArgs, EngineConfig
from engine.executor import make_executor
from engine.info import EngineInfo
from engine.kv.connector.base import KVConnectorRole
from engine.kv.connector.factory import create_connector
from engine.kv.kv_cache_spec import kv_cache_groups, max_request_len
from engine.kv.layout import KVLayout, spec_name
from engine.kv.manager import KVCacheManager
from engine.kv.zmq_publisher import create_event_publisher
from engine.lora.registry import LoRARegistry
from engine.lora.request import LoRARequest
from engine.models.files import load_config
from engine.models.loader import prepare_model_dir
from engine.multimodal.checks import MultiModalLimits, image_info
from engine.multimodal.encoder_cache import EncoderCacheManager
from engine.pooling.config import get_pooler_config
from engine.request import Request, RequestStatus
from engine.sched.output import EngineCoreOutput, SchedulerStats
from engine.sched.scheduler import Scheduler
from engine.structured_output.manager import StructuredOutputManager
from engine.worker.worker import Worker, resolve_device

logger = logging.getLogger("llmmesh.engine")


@dataclass
class StepStats:
    """One step, for metrics and detailed traces: its batch and where its time went (perf_counter seconds)."""

    step: int  # 1, 2, ... since the engine started
    num_reqs: int  # requests in the batch
    num_tokens: int  # tokens scheduled (prompt and decode)
    schedule_s: float
    model_s: float  # Worker.execute_model but sampling: the forward pass (and the KV connector's hand-offs)
    sample_s: float  # sampling, in process or on the sampler service (host time: on a GPU, kernels run ahead and
    # their time shows where the host next waits for them)
    update_s: float  # turning the runner's output into request outputs
    # Batches handed to the ranks whose output was not taken yet, after this step scheduled (pipeline parallelism:
    # up to --pipeline-parallel-size; otherwise 0, as each step takes its own batch's output).
    num_batches_in_flight: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig | EngineArgs):
        """From the composed configs, or from the flat EngineArgs (the offline LLM's keywords, the engine's flags)
        that make them."""
        if isinstance(config, EngineArgs):
            self.args, self.config = config, config.create_engine_config()
        else:
            self.args, self.config = EngineArgs.from_engine_config(config), config
        model = self.config.model_config
        self.config.scheduler_config.resolve(resolve_device(model.device).type)
        self.model_dir = prepare_model_dir(model.model, model.download_dir)
        # The checkpoint's architecture; self.config.model_config holds the settings it runs with.
        self.model_config = cfg = load_config(self.model_dir)
        self.max_model_len = model.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}."
            )

        # --runner pooling: how prompts are pooled (the worker's Pooler has the same); None: the engine generates.
        self.pooler_config = get_pooler_config(
            model.runner, model.pooler_config, cfg.has_lm_head, cfg.hidden_size, self.model_dir
        )
        self.runner_type = "generate" if self.pooler_config is None else "pooling"
        if self.pooler_config is not None and self.config.speculative_config is not None:
            raise ValueError("speculative_config is set, but a pooling engine (--runner pooling) decodes nothing.")
        # The layers grouped by what they keep in the KV cache (the worker shapes its cache by the same groups).
        self.kv_cache_groups = kv_cache_groups(cfg)
        self.executor = make_executor(self.config, cfg, self.model_dir, self.max_model_len)
        try:
            self._start(self.config)
        except BaseException:
            self.executor.shutdown()  # its tensor-parallel ranks end with it
            raise

    def _start(self, config: EngineConfig) -> None:
        """The KV cache, the scheduler and what they need, over the started executor."""
        cfg, cache, sched, lora = self.model_config, config.cache_config, config.scheduler_config, config.lora_config
        self.device, self.dtype = self.executor.device, self.executor.dtype
        self.num_blocks = self.executor.determine_num_available_blocks()
        self.executor.initialize_kv_cache(self.num_blocks)
        block_size = cache.block_size
        groups = self.kv_cache_groups
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s) in %d group(s) of %d layer(s)",
            self.num_blocks, block_size, self.num_blocks * block_size,
            self.num_blocks * self.executor.get_cache_block_size_bytes() / 2**30, self.executor.kv_cache_dtype,
            len(groups), max(len(g.layer_ids) for g in groups),
        )  # fmt: skip

        # LoRA adapters loaded: name -> its request, and id -> the digest of its weights (its blocks' extra key).
        self.lora_registry = LoRARegistry(lora.enable_lora)
        self.lora_digests = self.lora_registry.digests
        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            block_size,
            enable_caching=cache.enable_prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
            hash_seed=cache.prefix_caching_hash_seed,
            watermark=sched.watermark,
            enable_kv_cache_events=cache.enable_kv_cache_events,
            lora_digests=self.lora_digests,
            kv_cache_specs=[g.spec for g in groups],
            rope_switch_len=cfg.rope_switch_len(),
        )
        self.num_steps = 0
        self.last_step: StepStats | None = None
        # The steps' span context (set_step_trace_headers), which each step hands down with its SchedulerOutput.
        self.step_trace_headers: tuple[tuple[str, str], ...] = ()
        self.connector = None
        layouts = None
        kv_transfer_config = config.kv_transfer_config
        if kv_transfer_config is not None:  # the scheduler's half (the worker made its own with its KV cache)
            layouts = tuple(self.executor.get_kv_layouts())
            self.connector = create_connector(
                kv_transfer_config, KVConnectorRole.SCHEDULER, layouts, kv_cache_manager=self.kv_cache_manager
            )
            fingerprints = ", ".join(f"{spec_name(x.kv_cache_spec)} {x.fingerprint[:16]}" for x in layouts)
            logger.info("KV connector %s (%s), model fingerprints %s", kv_transfer_config.kv_connector,
                        kv_transfer_config.kv_role, fingerprints)  # fmt: skip
        self.structured_output_manager = StructuredOutputManager(self.model_dir, cfg.vocab_size, cfg.eos_token_ids)
        # A vision-language model's images: their checks, and the encoder cache the scheduler keeps (None: text-only).
        self.mm_info = image_info(cfg)
        self.mm_limits = MultiModalLimits(
            config.model_config.limit_mm_per_prompt,
            config.model_config.max_image_pixels,
            sched.max_num_encoder_input_tokens,
            sched.encoder_cache_size,
        )
        encoder_cache = (
            EncoderCacheManager(sched.encoder_cache_size, sched.encoder_cache_keep_unused)
            if self.mm_info is not None
            else None
        )
        if cfg.is_mm_prefix_lm:
            self.mm_info.check_chunk_budget(sched.max_num_batched_tokens, sched.long_prefill_token_threshold)
        # A request can never grow past the whole pool, so that is its length cap too.
        num_lookahead = self.executor.num_lookahead_tokens
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=sched.max_num_batched_tokens,
            max_num_seqs=sched.max_num_seqs,
            max_model_len=max_request_len(
                groups,
                self.kv_cache_manager.num_blocks,
                block_size,
                sched.max_num_batched_tokens + num_lookahead,
                self.max_model_len,
            ),
            scheduling_policy=sched.scheduling_policy,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            connector=self.connector,
            structured_output_manager=self.structured_output_manager,
            num_spec_tokens=spec.num_speculative_tokens if (spec := config.speculative_config) else 0,
            num_lookahead_tokens=num_lookahead,
            max_loras=lora.max_loras if lora.enable_lora else 0,
            rope_switch_len=cfg.rope_switch_len(),
            pipeline_parallel_size=config.parallel_config.pipeline_parallel_size,
            encoder_cache_manager=encoder_cache,
            max_num_encoder_input_tokens=sched.max_num_encoder_input_tokens,
            disable_chunked_mm_input=cfg.is_mm_prefix_lm,
        )
        # Pipeline parallelism: (scheduler output, its PipelineOutput) of the batches in flight, oldest first.
        self.batch_queue: deque = deque()
        self._aborted: list[EngineCoreOutput] = []
        self.info = self._make_info(layouts)
        for name, path in lora.get_lora_modules().items():
            self.add_lora(self.lora_registry.new_request(name, path))
        self.update_info()
        # vLLM's ZMQ publisher of the KV events (--kv-events-config), fed by take_kv_events; last, so a start that
        # fails leaves no socket bound.
        self.kv_event_publisher = create_event_publisher(config.kv_events_config)

    def _make_info(self, kv_layouts: tuple[KVLayout, ...] | None) -> EngineInfo:
        """The snapshot's fixed part; update_info() adds the adapters and the connector's figures."""
        config, cfg = self.config, self.model_config
        # The settings the snapshot shows under their own names (block_size, max_num_seqs, enable_lora, ...).
        shown = {f.name for f in fields(EngineInfo)}
        settings = {
            f.name: getattr(c, f.name)
            for c in (config.cache_config, config.scheduler_config, config.lora_config)
            for f in fields(c)
            if f.name in shown
        }
        return EngineInfo(
            model=config.model_config.model,
            model_dir=self.model_dir,
            architecture=cfg.embedding_architecture or cfg.architecture,
            runner_type=self.runner_type,
            vocab_size=cfg.vocab_size,
            max_model_len=self.max_model_len,
            eos_token_ids=tuple(cfg.eos_token_ids),
            bos_token_id=cfg.bos_token_id,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            max_logprobs=config.model_config.max_logprobs,
            num_blocks=self.num_blocks,
            attention_backend=self.executor.attention_backend,
            lora_adapters=MappingProxyType({}),
            lora_digests=MappingProxyType({}),
            kv_role=self.connector.config.kv_role if self.connector is not None else None,
            kv_layouts=kv_layouts,
            kv_connector_stats=None,
            **settings,
        )

    def update_info(self) -> EngineInfo:
        """The snapshot for the services (self.info), replaced by a new one when the loaded adapters or the
        connector's figures have changed since it was made. On the engine thread, after what may change them."""
        info = self.info
        stats = self.connector.get_kv_connector_stats() if self.connector is not None else None
        loras_changed = self.lora_registry != info.lora_adapters or self.lora_digests != info.lora_digests
        if loras_changed or stats != info.kv_connector_stats:
            self.info = replace(
                info,
                lora_adapters=MappingProxyType(dict(self.lora_registry)),
                lora_digests=MappingProxyType(dict(self.lora_digests)),
                kv_connector_stats=stats,
            )
        return self.info

    @property
    def worker(self) -> Worker:
        """Rank 0's worker, in this process, for tests that look inside it: the core itself goes through its
        executor."""
        return self.executor.driver_worker

    # ---- the API the offline LLM and the gRPC engine service drive -------------

    def add_request(self, request: Request) -> None:
        """Admit a request that engine.processor.Processor has checked (once, where it entered: the n children of
        one request are not checked again)."""
        request.eos_token_ids = request.eos_token_ids or tuple(self.model_config.eos_token_ids)
        if self.has_request(request.request_id):
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        lora = request.lora_request
        # Checked at admission; this catches an adapter unloaded since, while the request waited for this thread.
        if lora is not None and self.lora_registry.get(lora.lora_name) != lora:
            raise ValueError(f"lora_request: adapter {lora.lora_name!r} (id {lora.lora_int_id}) is not loaded.")
        if request.structured_output_request is not None:
            self.structured_output_manager.grammar_init(request)
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids) -> None:
        """End requests in any state; their blocks go back to the pool immediately."""
        for request in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self._aborted.append(
                EngineCoreOutput(request.request_id, [], request.get_finished_reason(), events=request.take_events())
            )

    def fail_running_requests(self) -> list[str]:
        """After a step raised: end every running request as aborted, without outputs; their ids."""
        return [r.request_id for r in self.scheduler.fail_running_requests()]

    def fail_requests(self, request_ids) -> list[str]:
        """End these requests (in any state but running in a failed step) as aborted, without outputs; their ids."""
        return [r.request_id for r in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)]

    def step(self) -> list[EngineCoreOutput]:
        if self.scheduler.pipelined:
            return self.step_with_batch_queue()
        began = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        scheduler_output.trace_headers = self.step_trace_headers  # the step carries its span context to the sampler
        started = time.perf_counter()
        # Async scheduling: the next step's blocks are allocated (and a step of decodes has its inputs built) while
        # this step's tokens are being sampled.
        while_waiting = (
            partial(self.scheduler.schedule_ahead, scheduler_output)
            if self.config.scheduler_config.async_scheduling
            else None
        )
        runner_output = self.executor.execute_model(scheduler_output, while_waiting)
        ran = time.perf_counter()
        if self.connector is not None:
            self.connector.record_step_time(scheduler_output, ran - started)  # for its own estimates
        failed = self._end_failed_requests(scheduler_output, runner_output)
        outputs = failed + self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_steps += 1
        sample_s = runner_output.sample_s
        self.last_step = StepStats(
            self.num_steps,
            len(scheduler_output.scheduled_requests),
            scheduler_output.total_num_scheduled_tokens,
            started - began,
            ran - started - sample_s,
            sample_s,
            time.perf_counter() - ran,
        )
        # Taken only once the step succeeded, so a failed step loses no abort outputs.
        aborted, self._aborted = self._aborted, []
        return aborted + outputs

    def step_with_batch_queue(self) -> list[EngineCoreOutput]:
        """Schedule a batch into the pipeline while it has room; take the oldest batch's output once it is full or
        nothing new was scheduled. A batch with nothing to run is handed on (the ranks forget finished requests)
        but not queued."""
        began = time.perf_counter()
        scheduled = None
        if len(self.batch_queue) < self.config.parallel_config.pipeline_parallel_size:
            scheduler_output = self.scheduler.schedule()
            scheduler_output.trace_headers = self.step_trace_headers
            started = time.perf_counter()
            future = self.executor.execute_model(scheduler_output, non_block=True)
            if not scheduler_output.is_empty:
                self.scheduler.update_after_schedule(scheduler_output)
                self.batch_queue.append((scheduler_output, future))
                scheduled = scheduler_output
        else:
            started = began
        in_flight = len(self.batch_queue)
        outputs = []
        ran = time.perf_counter()
        if self.batch_queue and (scheduled is None or in_flight == self._pp_size):
            scheduler_output, future = self.batch_queue.popleft()
            runner_output = future.result()
            ran = time.perf_counter()
            outputs = self._end_failed_requests(scheduler_output, runner_output)
            outputs += self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_steps += 1
        self.last_step = StepStats(
            self.num_steps,
            len(scheduled.scheduled_requests) if scheduled else 0,
            scheduled.total_num_scheduled_tokens if scheduled else 0,
            started - began,
            ran - started,
            0.0,  # the last stage samples, in another process
            time.perf_counter() - ran,
            in_flight,
        )
        aborted, self._aborted = self._aborted, []
        return aborted + outputs

    @property
    def _pp_size(self) -> int:
        return self.config.parallel_config.pipeline_parallel_size

    def _end_failed_requests(self, so, runner_output) -> list[EngineCoreOutput]:
        """Requests that failed on their own in this step (runner_output.failed) end now with FinishReason.ERROR,
        their blocks free; they leave the step's batch, so the rest of it is advanced as without them."""
        if not runner_output.failed:
            return []
        keep = [i for i, r in enumerate(so.scheduled_requests) if r.request_id not in runner_output.failed]
        if self.scheduler.pipelined:  # they leave the batch: it is back for them here
            for r in so.scheduled_requests:
                if r.request_id in runner_output.failed:
                    self.scheduler.batch_done(r)
        so.scheduled_requests = [so.scheduled_requests[i] for i in keep]
        runner_output.sampled_token_ids = [runner_output.sampled_token_ids[i] for i in keep]
        outputs = []
        # Their blocks leave the prefix cache: a request whose adapter could not be loaded ran as the base model.
        for request_id in runner_output.failed:
            self.scheduler.kv_cache_manager.evict_cached_blocks(self.scheduler.requests[request_id])
        for request in self.scheduler.finish_requests(list(runner_output.failed), RequestStatus.FINISHED_ERROR):
            failure = runner_output.failed[request.request_id]
            logger.warning("%s", failure.message)
            outputs.append(
                EngineCoreOutput(
                    request.request_id, [], request.get_finished_reason(), events=request.take_events(), failure=failure
                )
            )
        return outputs

    # ---- LoRA adapters ----------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load and check an adapter (ValueError: what is wrong with it); False if it is loaded already."""
        if not self.lora_registry.check_new(lora_request):
            return False
        try:  # on every tensor-parallel rank; one that refuses it leaves it on none
            digest = self.executor.collective_rpc("add_lora", (lora_request,))[0]
        except ValueError:
            self.executor.collective_rpc("remove_lora", (lora_request.lora_int_id,))
            raise
        self.lora_registry.add(lora_request, digest)
        return True

    def remove_lora(self, lora_int_id_or_name: int | str) -> bool:
        """Unload an adapter (by id or name); False if none such is loaded. ValueError while requests use it."""
        lora = self.lora_registry.find(lora_int_id_or_name)
        if lora is None:
            return False
        in_flight = self.scheduler.requests_with_lora(lora.lora_int_id)
        if in_flight:
            raise ValueError(
                f"LoRA adapter {lora.lora_name!r} has {in_flight} request(s) in flight; unload it once they end."
            )
        self.executor.collective_rpc("remove_lora", (lora.lora_int_id,))
        self.lora_registry.remove(lora)
        return True

    def list_loras(self) -> set[int]:
        return {r.lora_int_id for r in self.lora_registry.values()}

    def set_step_trace_headers(self, trace_headers: tuple[tuple[str, str], ...]) -> None:
        """The next step's span context (--collect-detailed-traces): its call to the sampler service joins it."""
        self.step_trace_headers = trace_headers

    def has_unfinished_requests(self) -> bool:
        """Requests to step, or KV transfers whose end the engine must still see (blocks they hold)."""
        pending = self.connector is not None and self.connector.has_pending_transfers()
        # A batch in flight whose requests ended (aborted) still has its output to take.
        pending = pending or bool(self.batch_queue)
        return self.scheduler.has_unfinished_requests() or bool(self._aborted) or pending

    def num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def has_request(self, request_id: str) -> bool:
        """Whether request_id is waiting or running here."""
        return request_id in self.scheduler.requests

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the local prefix cache (the KV store keeps its blocks); False while requests hold blocks."""
        while (
            self.connector is not None
            and self.connector.has_pending_transfers()
            and not self.scheduler.has_unfinished_requests()
        ):
            self.step()  # let finished stores give back the blocks they hold
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
        if self.connector is not None:
            self.connector.shutdown()
        self.structured_output_manager.shutdown()
        self.executor.shutdown()

    def take_kv_events(self):
        """The KV cache's events since the last call (once per step), handed to the ZMQ publisher too."""
        events = self.kv_cache_manager.take_events()
        if events and self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(events)
        return events
