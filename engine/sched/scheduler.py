"""The continuous-batching scheduler: a token budget per step, running requests first.

There is no separate prefill phase: a request owes `num_tokens - num_computed_tokens`
tokens, and each step gives it as many as the budget allows. A prompt larger than the
budget is therefore chunked across steps, and decodes ride in the same batch.

With pipeline parallelism several batches are in flight at once (EngineCore.step_with_batch_queue), so a request's
computed tokens advance when its batch is handed to the ranks (update_after_schedule), as vLLM's do: its next prompt
chunk can go in the next batch, while a request whose last batch samples a token owes nothing until that token is
back (update_from_output). A request preempted with a batch in flight is not admitted again before that batch's
output is back, and that output is dropped.
"""

import concurrent.futures
from dataclasses import replace

from engine.kv.manager import KVCacheManager
from engine.request import EngineCoreEventType, FinishReason, Request, RequestFailure, RequestStatus
from engine.sample.sampler import LogprobsTensors
from engine.sched.output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from engine.sched.request_queue import create_request_queue
from engine.spec_decode.metrics import SpecDecodingStats

# How long a step with nothing to run waits for a grammar to compile (new requests wait as long at most).
GRAMMAR_WAIT_S = 0.01


class Scheduler:
    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        scheduling_policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
        connector=None,
        structured_output_manager=None,
        num_spec_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        max_loras: int = 0,
        rope_switch_len: int | None = None,
        pipeline_parallel_size: int = 1,
        encoder_cache_manager=None,
        max_num_encoder_input_tokens: int = 0,
        disable_chunked_mm_input: bool = False,
    ):
        self.kv_cache_manager = kv_cache_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = scheduling_policy
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.requests: dict[str, Request] = {}
        self.waiting = create_request_queue(scheduling_policy)
        self.running: list[Request] = []
        # WAITING_FOR_REMOTE_KVS: blocks reserved, a KV connector loading into them (no token budget used).
        self.loading: set[Request] = set()
        self.connector = connector
        # Builds each step's grammar bitmask (engine.structured_output.manager.StructuredOutputManager).
        self.structured_output_manager = structured_output_manager
        # Requests that failed on their own while waiting (their grammar did not compile): output with the next step.
        self.failed_outputs: list[EngineCoreOutput] = []
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        # Speculative decoding: each decoding request verifies up to num_spec_tokens drafts per step.
        self.spec_decoding_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        # Slots reserved past a request's scheduled tokens, where a draft model writes its drafts' KV.
        self.num_lookahead_tokens = num_lookahead_tokens
        # Adapters one step may run at most (the device's LoRA slots); 0: LoRA is off.
        self.max_loras = max_loras
        # A model whose rope switches past this length (ModelArchConfig.rope_switch_len): a request that grows past
        # it is recomputed from its first token, as transformers does.
        self.rope_switch_len = rope_switch_len
        # Async scheduling: request id -> the new tokens its blocks were allocated for by schedule_ahead.
        self.allocated_ahead: dict[str, int] = {}
        # Pipeline parallelism: batches in flight at once; each request with batches in flight -> how many.
        self.pipelined = pipeline_parallel_size > 1
        self.num_batches_in_flight: dict[Request, int] = {}
        # A vision-language model's encoder cache (engine.multimodal.encoder_cache), and the image embedding tokens
        # the encoder computes in one step at most; None: a text-only model.
        self.encoder_cache_manager = encoder_cache_manager
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        # An image's placeholders go in one step, never split across prefill chunks (a prefix-LM model's attend to
        # each other both ways).
        self.disable_chunked_mm_input = disable_chunked_mm_input

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.add_request(request)

    def finish_requests(self, request_ids, finished_status: RequestStatus) -> list[Request]:
        """End requests in any state (abort); their blocks return to the pool now."""
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                # Its blocks are being written: they are freed when the load ends (_finish_load).
                request.status = finished_status
                self.finished_req_ids.add(request_id)
                finished.append(request)
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._free_request(request)
            finished.append(request)
        return finished

    def fail_running_requests(self) -> list[Request]:
        """After a failed step, abort every running request.

        That step registered the blocks it was to fill in the prefix cache, but never wrote them,
        so the failed requests' blocks leave the cache before they are freed.
        """
        for request in self.running:
            self.kv_cache_manager.evict_cached_blocks(request)
        if self.connector is not None:
            self.connector.abandon_stores()
        return self.finish_requests([r.request_id for r in self.running], RequestStatus.FINISHED_ABORTED)

    def _free_request(self, request: Request) -> None:
        if request.structured_output_request is not None and request.structured_output_request.grammar is not None:
            request.structured_output_request.grammar.cancel()  # a compile that has not started yet never runs
        if self.encoder_cache_manager is not None:
            self.encoder_cache_manager.free(request)
        if self.connector is not None:
            self.connector.request_finished(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def get_num_unfinished_requests(self) -> int:
        loading = sum(1 for r in self.loading if not r.is_finished())
        return len(self.waiting) + len(self.running) + loading + len(self.failed_outputs)

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def make_stats(self) -> SchedulerStats:
        prefix = self.kv_cache_manager.prefix_cache_stats
        encoder = self.encoder_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage(),
            prefix_cache_queries=prefix.queries,
            prefix_cache_hits=prefix.hits,
            num_preemptions=self.num_preemptions,
            num_blocks=self.kv_cache_manager.num_blocks,
            num_loading_reqs=len(self.loading),
            kv_connector_stats=self.connector.get_kv_connector_stats().data if self.connector is not None else None,
            spec_decoding_stats=self.spec_decoding_stats,
            encoder_cache_usage=encoder.usage() if encoder is not None else None,
            encoder_cache_stats=replace(encoder.stats) if encoder is not None else None,
            **self._lora_adapter_counts(),
        )

    def _lora_adapter_counts(self) -> dict[str, dict[str, int]]:
        """Adapter name -> requests running, and waiting (loading too), as vLLM's lora_requests_info counts them."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        if self.max_loras:
            for r in self.requests.values():
                if r.lora_request is not None:
                    counts = running if r.status == RequestStatus.RUNNING else waiting
                    counts[r.lora_request.lora_name] = counts.get(r.lora_request.lora_name, 0) + 1
        return {"running_lora_adapters": running, "waiting_lora_adapters": waiting}

    # ---- one step ------------------------------------------------------------

    def _num_new_tokens(self, request: Request, num_computed_tokens: int, token_budget: int) -> int:
        num_new_tokens = request.num_tokens_with_spec - num_computed_tokens
        if 0 < self.long_prefill_token_threshold < num_new_tokens:
            num_new_tokens = self.long_prefill_token_threshold
        return min(num_new_tokens, token_budget)

    def schedule(self) -> SchedulerOutput:
        token_budget = self.max_num_batched_tokens
        allocated_ahead, self.allocated_ahead = self.allocated_ahead, {}
        scheduled: list[Request] = []
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_decode_tokens: dict[str, list[int]] = {}
        preempted: list[Request] = []
        encoder_budget = self.max_num_encoder_input_tokens
        scheduled_encoder_inputs: dict[str, list] = {}

        # Running requests first: decodes and unfinished prefill chunks.
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, token_budget)
            encoder_inputs: list[int] = []
            if num_new_tokens and request.mm_features and self.encoder_cache_manager is not None:
                encoder_inputs, num_new_tokens, encoder_budget = self._try_schedule_encoder_inputs(
                    request, request.num_computed_tokens, num_new_tokens, encoder_budget
                )
            if num_new_tokens == 0:
                req_index += 1
                continue
            while True:
                if allocated_ahead.get(request.request_id) == num_new_tokens:  # done while the last step sampled
                    # Only the block its newest token completed is left to register in the prefix cache.
                    self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens + num_new_tokens)
                    new_blocks = []
                    break
                new_blocks = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens + self._num_lookahead(request.num_computed_tokens + num_new_tokens)
                )
                if new_blocks is not None:
                    break
                # Out of blocks: preempt until this request fits, or it is the victim itself.
                victim = self._pick_victim()
                if victim.request_id in num_scheduled_tokens:
                    scheduled.remove(victim)
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    scheduled_spec_decode_tokens.pop(victim.request_id, None)
                    req_index -= 1
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if new_blocks is None:
                break
            scheduled.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            req_index += 1
            self._allocate_encoder_inputs(request, encoder_inputs, scheduled_encoder_inputs)
            # The drafts that fit this step go to the runner; the request proposes anew after it.
            num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
            if num_spec > 0:
                scheduled_spec_decode_tokens[request.request_id] = request.spec_token_ids[:num_spec]
            request.spec_token_ids = []

        # Then waiting requests, but never in a step that had to preempt.
        # Waiting on the KV connector's answer or on their grammar: they keep their place in line.
        skipped: list[Request] = []
        running_loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        while not preempted and len(self.waiting) and token_budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            request = self.waiting.peek_request()
            if request in self.num_batches_in_flight:  # preempted in flight: its stale output is still to come
                skipped.append(self.waiting.pop_request())
                continue
            if request.status == RequestStatus.WAITING_FOR_FSM:
                if not request.structured_output_request.is_grammar_ready():  # the requests behind it go first
                    skipped.append(self.waiting.pop_request())
                    continue
                if not self._grammar_compiled(request):
                    continue
            lora = request.lora_request
            if lora is not None and lora.lora_int_id not in running_loras and len(running_loras) >= self.max_loras:
                skipped.append(self.waiting.pop_request())  # no slot for its adapter this step: it keeps its place
                continue
            # A request back from a KV load already holds its computed prefix.
            num_cached = request.num_computed_tokens
            computed_blocks, num_local, num_external, load_async = [], 0, 0, False
            # Prompt logprobs and a MEAN or CLS pooling need every prompt position to run: no cache hits for them.
            caching = self.kv_cache_manager.enable_caching
            queried = caching and num_cached == 0 and not request.skip_reading_prefix_cache
            if queried:
                computed_blocks, num_local = self.kv_cache_manager.get_computed_blocks(request)
                if self.connector is not None:
                    num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_local)
                    if num_external is None:  # its lookup is still out: try the requests behind it
                        skipped.append(self.waiting.pop_request())
                        continue
            if load_async:
                if not self._start_load(request, computed_blocks, num_local, num_external, queried):
                    break
                continue
            num_new_tokens = self._num_new_tokens(request, num_cached + num_local, token_budget)
            encoder_inputs = []
            if request.mm_features and self.encoder_cache_manager is not None:
                encoder_inputs, num_new_tokens, encoder_budget = self._try_schedule_encoder_inputs(
                    request, num_cached + num_local, num_new_tokens, encoder_budget
                )
                if num_new_tokens == 0:  # its next image does not fit this step's encoder budget or the cache
                    break
            new_blocks = self.kv_cache_manager.allocate_slots(
                request,
                num_new_tokens + self._num_lookahead(num_cached + num_local + num_new_tokens),
                num_local,
                computed_blocks,
                apply_watermark=bool(self.running),
            )
            if new_blocks is None:
                if num_cached:
                    # Back from a load but short of blocks for the rest: a waiting request holds no blocks (two
                    # such requests could otherwise wait on each other forever). The loaded blocks stay in the
                    # prefix cache, so its next try starts with them as local hits.
                    self.kv_cache_manager.free(request)
                    request.num_computed_tokens = 0
                break
            self._admitted(request, num_local, queried)
            if lora is not None:
                running_loras.add(lora.lora_int_id)
            num_cached += num_local
            self.waiting.pop_request()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
            request.record_event(EngineCoreEventType.SCHEDULED)
            scheduled.append(request)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            self._allocate_encoder_inputs(request, encoder_inputs, scheduled_encoder_inputs)
            if self.connector is not None:
                self.connector.update_state_after_alloc(
                    request, self.kv_cache_manager.req_to_blocks[request.request_id], 0
                )
        compiling = [r.structured_output_request.grammar for r in skipped if r.status == RequestStatus.WAITING_FOR_FSM]
        if compiling and not scheduled:  # nothing to run but grammars to wait for: wait a little, do not spin
            concurrent.futures.wait(compiling, timeout=GRAMMAR_WAIT_S, return_when=concurrent.futures.FIRST_COMPLETED)
        for request in reversed(skipped):
            self.waiting.prepend_request(request)

        output = SchedulerOutput(
            scheduled_requests=scheduled,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_batched_tokens - token_budget,
            block_ids={r.request_id: self.kv_cache_manager.get_block_ids(r.request_id) for r in scheduled},
            preempted_req_ids={r.request_id for r in preempted},
            finished_req_ids=self.finished_req_ids,
            scheduled_spec_decode_tokens=scheduled_spec_decode_tokens,
            scheduled_encoder_inputs=scheduled_encoder_inputs,
        )
        if self.encoder_cache_manager is not None:
            output.free_encoder_mm_hashes = self.encoder_cache_manager.get_freed_mm_hashes()
        self._add_grammar_bitmask(output)
        self.finished_req_ids = set()
        if self.connector is not None:
            output.kv_connector_metadata = self.connector.build_connector_meta(output)
        return output

    def update_after_schedule(self, scheduler_output: SchedulerOutput) -> None:
        """Pipeline parallelism: once the batch is handed to the ranks (which read where each request starts), its
        requests' tokens count as computed, so that the next batch schedules what comes after them."""
        for request in scheduler_output.scheduled_requests:
            request.num_computed_tokens += scheduler_output.num_scheduled_tokens[request.request_id]
            self.num_batches_in_flight[request] = self.num_batches_in_flight.get(request, 0) + 1

    def batch_done(self, request: Request) -> bool:
        """Pipeline parallelism: one of the request's batches is back; whether its output is still wanted (not if
        the request was preempted or finished since)."""
        left = self.num_batches_in_flight.pop(request) - 1
        if left:
            self.num_batches_in_flight[request] = left
        return request.status == RequestStatus.RUNNING

    def schedule_ahead(self, in_flight: SchedulerOutput) -> SchedulerOutput | None:
        """While in_flight's tokens are being sampled, allocate the running requests' blocks for the next step
        (vLLM's async scheduling): each request that samples in in_flight counts one more token, its output
        placeholder. The next schedule() keeps what it decides the same, so outputs do not change; it alone
        preempts (this stops at the first request that does not fit) and admits waiting requests. Not with
        speculative decoding: a step's drafts are known only from its output.

        Returns the next step as it will be if every running request decodes on, one token each (for the model
        runner to prepare its inputs ahead), or None when it will not be a step of decodes alone."""
        if self.spec_decoding_stats is not None:
            return None
        token_budget = self.max_num_batched_tokens
        decodes: list[Request] = []
        for request in self.running:
            if token_budget <= 0:
                break
            num_pending = in_flight.num_scheduled_tokens.get(request.request_id, 0)
            num_computed = request.num_computed_tokens + num_pending
            num_placeholders = int(num_pending > 0 and num_computed >= request.num_tokens)
            num_new_tokens = self._num_new_tokens(request, num_computed - num_placeholders, token_budget)
            if num_new_tokens == 0:
                continue
            if self.kv_cache_manager.allocate_slots(request, num_pending + num_new_tokens) is None:
                return None
            self.allocated_ahead[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            if num_new_tokens == num_placeholders == 1:
                decodes.append(request)
        if not decodes or len(decodes) < len(self.running):
            return None
        return SchedulerOutput(
            scheduled_requests=decodes,
            num_scheduled_tokens={r.request_id: 1 for r in decodes},
            total_num_scheduled_tokens=len(decodes),
            block_ids={r.request_id: self.kv_cache_manager.get_block_ids(r.request_id) for r in decodes},
        )

    # ---- images: the encoder's budget and cache -------------------------------------------------------

    def _try_schedule_encoder_inputs(
        self, request: Request, num_computed_tokens: int, num_new_tokens: int, encoder_budget: int
    ) -> tuple[list[int], int, int]:
        """The images whose embeddings this step's tokens [num_computed, num_computed + num_new) need and the
        encoder must compute (those not held already); the new-token count, cut short before the first image that
        does not fit the step's encoder budget or the cache (an image is encoded whole, in one step), or, with
        disable_chunked_mm_input, whose placeholders the step would split; the budget left (vLLM's
        _try_schedule_encoder_inputs)."""
        manager, to_schedule, num_tokens_to_schedule = self.encoder_cache_manager, [], 0
        end = num_computed_tokens + num_new_tokens
        for i, feature in enumerate(request.mm_features):
            start, length = feature.mm_position.offset, feature.mm_position.length
            if start >= end:
                break  # this step's tokens end before it
            if start + length <= num_computed_tokens:
                continue  # its embeddings are in the KV cache already
            if self.disable_chunked_mm_input and start + length > end:
                # The step would end inside the image: stop before it (or, starting inside it after a prefix-cache
                # hit, wait for a step that reaches its end).
                num_new_tokens = max(0, start - num_computed_tokens)
                break
            if feature.identifier in {request.mm_features[j].identifier for j in to_schedule}:
                continue  # the same image again in this prompt: computed once
            if manager.check_and_update_cache(request, i):
                continue  # held: computed for an earlier chunk, or for another request with the same image
            if not manager.can_allocate(request, i, encoder_budget, num_tokens_to_schedule):
                num_new_tokens = max(0, start - num_computed_tokens)  # stop before it; it goes in a later step
                break
            num_tokens_to_schedule += length
            encoder_budget -= length
            to_schedule.append(i)
        return to_schedule, num_new_tokens, encoder_budget

    def _allocate_encoder_inputs(self, request: Request, input_ids: list[int], scheduled: dict[str, list]) -> None:
        if input_ids:
            for i in input_ids:
                self.encoder_cache_manager.allocate(request, i)
            scheduled[request.request_id] = [request.mm_features[i] for i in input_ids]

    def _free_encoder_inputs(self, request: Request) -> None:
        """Images whose placeholders are all in the KV cache now: the request needs their embeddings no more
        (unless the same image comes again later in its prompt)."""
        pending = {f.identifier for f in request.mm_features if f.mm_position.end > request.num_computed_tokens}
        for i, feature in enumerate(request.mm_features):
            if feature.mm_position.end <= request.num_computed_tokens and feature.identifier not in pending:
                self.encoder_cache_manager.free_encoder_input(request, i)

    # ---- structured output ---------------------------------------------------------------------------

    def _grammar_compiled(self, request: Request) -> bool:
        """The first waiting request's grammar is ready: it waits as any other now; or it failed to compile, and the
        request ends alone (False)."""
        error = request.structured_output_request.grammar.exception()
        if error is not None:
            self.waiting.pop_request()
            failure = RequestFailure.from_exception(request.request_id, "structured output", error)
            self.failed_outputs.append(self._end_with_error(request, failure))
            return False
        request.status = RequestStatus.WAITING
        return True

    def _add_grammar_bitmask(self, output: SchedulerOutput) -> None:
        """One bitmask row for each structured request that samples in this step (its prompt complete)."""
        structured = [
            r
            for r in output.scheduled_requests
            if r.structured_output_request is not None
            and r.num_computed_tokens + output.num_scheduled_tokens[r.request_id] >= r.num_tokens
        ]
        if structured:
            # With drafts a request has a row per verified position: its first row here, the others after it.
            spec, row = output.scheduled_spec_decode_tokens, 0
            for r in structured:
                output.structured_output_request_ids[r.request_id] = row
                row += 1 + len(spec.get(r.request_id, ()))
            output.grammar_bitmask = self.structured_output_manager.grammar_bitmask(structured, spec)

    # ---- loads from a KV connector -------------------------------------------------------------

    def _admitted(self, request: Request, num_local: int, queried: bool) -> None:
        """Count a request's prefix-cache query at its first admission: once, however many steps it waited."""
        if queried and request.num_cached_tokens < 0:
            self.kv_cache_manager.prefix_cache_stats.record(request.num_tokens, num_local)

    def _start_load(self, request: Request, computed_blocks, num_local: int, num_external: int, queried: bool) -> bool:
        """Reserve blocks for the external tokens and park the request while they load; False if the
        pool is short (the request then stays first in line)."""
        blocks = self.kv_cache_manager.allocate_slots(
            request,
            num_external,
            num_local,
            computed_blocks,
            apply_watermark=bool(self.running),
            delay_cache_blocks=True,
        )
        if blocks is None:
            return False
        self._admitted(request, num_local, queried)
        self.waiting.pop_request()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        request.num_computed_tokens = num_local
        request.record_event(EngineCoreEventType.KV_LOAD_STARTED, num_tokens=num_external)
        self.loading.add(request)
        self.connector.update_state_after_alloc(
            request, self.kv_cache_manager.req_to_blocks[request.request_id], num_external
        )
        return True

    def _finish_load(self, request: Request, num_loaded_tokens: int) -> None:
        """The load ended (completely, or short after a fault): what arrived joins the prefix cache, and
        the request queues again to prefill the rest."""
        self.loading.discard(request)
        if request.is_finished():  # aborted while loading: only now are its blocks free to reuse
            self.connector.request_finished(request)
            self.kv_cache_manager.free(request)
            del self.requests[request.request_id]
            return
        request.num_computed_tokens += num_loaded_tokens
        request.record_event(EngineCoreEventType.KV_LOADED, num_tokens=num_loaded_tokens)
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens, loaded_from=self.connector.medium)
        request.num_cached_tokens = request.num_computed_tokens
        request.status = RequestStatus.WAITING
        self.waiting.prepend_request(request)

    def update_from_connector_output(self, output) -> None:
        self.connector.update_connector_output(output)
        for request_id, num_tokens in output.finished_recving.items():
            self._finish_load(self.requests[request_id], num_tokens)

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            # The least important running request: largest (priority, arrival).
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
            return victim
        # FCFS: the most recently admitted.
        return self.running.pop()

    def _preempt(self, request: Request) -> None:
        self._free_for_recompute(request)
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.record_event(EngineCoreEventType.PREEMPTED)
        self.waiting.prepend_request(request)

    def _free_for_recompute(self, request: Request) -> None:
        # Recompute preemption: drop the KV cache and start the request over later. Its output tokens stay, and so
        # does its grammar matcher, which has accepted exactly them.
        self.kv_cache_manager.free(request)
        if self.encoder_cache_manager is not None:
            self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []

    def _crossed_rope_switch(self, request: Request, num_new_tokens: int) -> bool:
        switch = self.rope_switch_len
        return switch is not None and request.num_tokens - num_new_tokens <= switch < request.num_tokens

    def _switch_rope(self, request: Request) -> None:
        """The request just grew past rope_switch_len: its KV was rotated with the short rope, and transformers
        recomputes the whole sequence with the long one there. So does the engine, by a recompute preemption (not
        counted as one); its blocks are named anew with the long rope's key (KVCacheManager), so the prefix cache
        still serves the short ones to short requests and never mixes the two."""
        self.running.remove(request)
        self._free_for_recompute(request)
        request.block_hashes.clear()
        self.waiting.prepend_request(request)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance each scheduled request; those whose chunk reached the end get their tokens.

        With speculative decoding a request gets its accepted drafts and the target's token, checked one by one
        (a stop in the middle ends it there); the KV of its rejected drafts is rolled back (num_computed_tokens),
        to be written over."""
        outputs, self.failed_outputs = self.failed_outputs, []
        if runner_output.kv_connector_output is not None:
            self.update_from_connector_output(runner_output.kv_connector_output)
        spec = scheduler_output.scheduled_spec_decode_tokens
        for request_id, runs in runner_output.encoder_runs.items():
            request = self.requests.get(request_id)
            for start, end, num_tokens in runs if request is not None else ():
                request.record_event(EngineCoreEventType.ENCODE_STARTED, start, num_tokens)
                request.record_event(EngineCoreEventType.ENCODED, end, num_tokens)
        for request, token_ids in zip(scheduler_output.scheduled_requests, runner_output.sampled_token_ids):
            if not self.pipelined:
                request.num_computed_tokens += scheduler_output.num_scheduled_tokens[request.request_id]
            elif not self.batch_done(request):
                continue
            if request.mm_features and self.encoder_cache_manager is not None:
                self._free_encoder_inputs(request)
            if request.pooling_params is not None:
                if request.num_computed_tokens >= request.num_tokens:  # its one prefill is done: so is it
                    outputs.append(self._finish_pooling(request, runner_output.pooler_output[request.request_id]))
                continue
            if not token_ids or request.num_computed_tokens < request.num_tokens:
                continue  # a partial prefill chunk emits nothing
            drafts = spec.get(request.request_id)
            if drafts:
                request.num_computed_tokens -= len(drafts) + 1 - len(token_ids)
                self.spec_decoding_stats.observe_draft(len(drafts), len(token_ids) - 1)
            new_token_ids, stopped, failure = [], False, None
            for token_id in token_ids:
                # Advance the grammar's matcher. It rejects a token only if the mask let through one it does not
                # allow: a bug, not the request's input.
                so_request = request.structured_output_request
                if so_request is not None and not so_request.matcher.accept_token(token_id):
                    failure = f"request {request.request_id}: structured output failed: the grammar rejected token "
                    failure += str(token_id)
                    break
                request.append_output_token_ids(token_id)
                new_token_ids.append(token_id)
                stopped = self.check_stop(request)
                if stopped:
                    break
            if failure is not None:
                self.running.remove(request)
                outputs.append(self._end_with_error(request, RequestFailure(failure)))
                continue
            if stopped:
                self.running.remove(request)
                self._free_request(request)
            elif self._crossed_rope_switch(request, len(new_token_ids)):
                self._switch_rope(request)
            else:
                proposed = runner_output.spec_token_ids.get(request.request_id, [])[: self._max_num_drafts(request)]
                if proposed and request.structured_output_request is not None:
                    proposed = self.structured_output_manager.validate_tokens(request, proposed)
                request.spec_token_ids = proposed
            logprobs = runner_output.logprobs.get(request.request_id)
            if logprobs is not None and len(new_token_ids) < len(token_ids):  # a stop among them: its rows only
                n = len(new_token_ids)
                logprobs = LogprobsTensors(logprobs.token_ids[:n], logprobs.logprobs[:n], logprobs.ranks[:n])
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=new_token_ids,
                    finish_reason=request.get_finished_reason(),
                    stop_reason=request.stop_reason,
                    events=request.take_events(),
                    num_cached_tokens=request.num_cached_tokens,
                    new_logprobs=logprobs,
                    new_prompt_logprobs=runner_output.prompt_logprobs.get(request.request_id),
                )
            )
        return outputs

    def _finish_pooling(self, request: Request, pooled) -> EngineCoreOutput:
        """A pooling request whose prompt has run: it ends "stop" with its pooled vector, and its blocks are free."""
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED
        self._free_request(request)
        return EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            finish_reason=request.get_finished_reason(),
            events=request.take_events(),
            num_cached_tokens=request.num_cached_tokens,
            pooling_output=pooled,
        )

    def _num_lookahead(self, num_tokens: int) -> int:
        """Lookahead slots after num_tokens, within the length cap."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_tokens))

    def _max_num_drafts(self, request: Request) -> int:
        """Drafts whose verification cannot overrun max_tokens or the length cap (a step adds one token more)."""
        room = self.max_model_len - request.num_tokens
        switch = self.rope_switch_len
        if switch is not None and request.num_tokens <= switch:
            # A short-rope request verifies no draft past the switch (the token there needs the long rope).
            room = min(room, switch + 1 - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        return max(0, room - 1)

    def _end_with_error(self, request: Request, failure: RequestFailure) -> EngineCoreOutput:
        """End a request that failed on its own, already out of the queues; its output."""
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        return EngineCoreOutput(
            request.request_id, [], FinishReason.ERROR, events=request.take_events(), failure=failure
        )

    def requests_with_lora(self, lora_int_id: int) -> int:
        """Requests in flight (waiting, loading or running) with this adapter."""
        return sum(1 for r in self.requests.values() if r.lora_request and r.lora_request.lora_int_id == lora_int_id)

    def check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        if request.num_tokens >= self.max_model_len or (
            params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        ):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_output_tokens < params.min_tokens:
            return False
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        if request.structured_output_request is not None and request.structured_output_request.matcher.is_terminated():
            # The grammar is complete and took its stop token (EOS, even with ignore_eos): vLLM's "stop".
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        return False
