"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, samples.

It samples through its BatchSampler, in process (LocalSampler) or on the sampler service (RemoteSampler): the
same rows and prompt-logprob chunks go either way, and the same outputs come back. A row whose request failed
on its own in sampling gets no token, and the request is reported in ModelRunnerOutput.failed.

Nothing in a step waits for the device but the one read of the sampled tokens: inputs are built on the
host and copied without waiting (engine.worker.cuda_graphs.InputBuffers), and a decode-only step with
CUDA graphs captured replays one instead of launching the model's kernels one by one.

With pipeline parallelism a stage's runner runs its layers only: a stage after the first receives the previous
stage's hidden states for the batch (the residual is part of them in these decoder layers), and a stage before the
last sends its own on and returns no tokens; the last computes the logits and samples as a lone runner does.
"""

import time
from functools import partial

import torch

from engine.attention.backend import layer_metadata
from engine.distributed.parallel_state import is_first_stage, is_last_stage, recv_from_prev_stage, send_to_next_stage
from engine.kv.manager import cdiv
from engine.pooling.pooler import Pooler
from engine.request import RequestFailure
from engine.sample.metadata import GrammarBitmask
from engine.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, DraftTokens
from engine.sample.sampler import BatchSampler, LocalSampler, LogprobsTensors
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.cuda_graphs import CUDAGraphs, InputBuffers


class ModelRunner:
    def __init__(
        self,
        model,
        kv_caches,
        block_size: int,
        device: torch.device,
        max_num_tokens: int,
        max_num_reqs: int,
        max_model_len: int,
        sampler: BatchSampler | None = None,
        lora_manager=None,
        is_driver: bool = True,
        layer_to_group: list[int] | None = None,
        pooler: Pooler | None = None,
        dtype: torch.dtype = torch.float32,
    ):
        """layer_to_group: each layer's KV cache group (engine.kv.kv_cache_spec); None: one group. pooler: a pooling
        engine's (--runner pooling), which pools each prompt's hidden states instead of sampling. dtype: the
        model's compute dtype, that of the hidden states pipeline stages pass on."""
        self.model = model
        self.dtype = dtype
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.layer_to_group = layer_to_group or [0] * len(kv_caches)
        # Past this many tokens a request's whole sequence is rotated with the model's other rope (its positions
        # offset by it into the rope table); the scheduler recomputes a request that grows past it.
        self.rope_switch_len = model.config.rope_switch_len()
        self.buffers = InputBuffers(
            max_num_tokens,
            max_num_reqs,
            cdiv(max_model_len, block_size),
            block_size,
            device,
            max(self.layer_to_group, default=0) + 1,
        )
        self.cudagraphs: CUDAGraphs | None = None  # set by capture_cudagraphs
        # Seconds the last step waited for the device (reading its sampled tokens): the rest was host work.
        self.device_wait_s = 0.0
        self.sampler = sampler or LocalSampler(device)
        self.pooler = pooler
        # Hidden states of pooling requests whose prompt is still being prefilled in chunks (MEAN and CLS pool them).
        self.pooling_in_progress: dict[str, list[torch.Tensor]] = {}
        # Prompt logprobs of requests whose prompt is still being prefilled in chunks.
        self.prompt_logprobs_in_progress: dict[str, list[LogprobsTensors]] = {}
        # Speculative decoding's proposer (engine.spec_decode); None: off.
        self.drafter = None
        # engine.lora.manager.LoRAModelManager with --enable-lora: puts a step's adapters in slots.
        self.lora_manager = lora_manager
        # This step's requests whose adapter could not be put in a slot: they fail alone, computed as the base model.
        self.lora_failures: dict[str, RequestFailure] = {}
        # False on tensor-parallel ranks 1..N-1: they run each step's collectives with rank 0, which alone samples.
        self.is_driver = is_driver
        # Async scheduling: the next step's batch, prepared while this step's tokens were sampled (its key, its
        # inputs); steps that used it.
        self.prepared_ahead: tuple[tuple, tuple] | None = None
        self.num_prepared_ahead = 0
        # A vision-language model's image embeddings by content hash (the scheduler's EncoderCacheManager says what
        # to compute and what to drop); and where each request of the batch last prepared starts.
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.batch_starts: list[int] = []
        # M-RoPE (Qwen2-VL): each request's prompt positions [3, prompt length] and the delta of the tokens after.
        self.mrope_positions: dict[str, tuple[torch.Tensor, int]] = {}
        # This step's images encoded: request_id -> (start, end, embedding tokens), for the request's trace.
        self.encoder_runs: dict[str, list[tuple[float, float, int]]] = {}

    def capture_cudagraphs(self, sizes: list[int]) -> None:
        """CUDA graphs of the model's forward for decode batches of these sizes (after the KV cache exists)."""
        self.cudagraphs = CUDAGraphs(self.model, self.kv_caches, self.buffers, sizes, self.layer_to_group)
        self.cudagraphs.capture()

    def prepare_inputs(self, so: SchedulerOutput):
        """The flat super-sequence: every scheduled token of every request, decodes first.

        Also the rows to sample (those whose prompt is complete after this step), and the CUDA graph size the
        batch runs as (None: eagerly). A batch prepared ahead (prepare_ahead) is used when this is that batch:
        only the tokens sampled since are written into it."""
        prepared, self.prepared_ahead = self.prepared_ahead, None
        if prepared is not None and prepared[0] == _batch_key(
            so, [r.num_computed_tokens for r in so.scheduled_requests]
        ):
            requests, order, rows, size, _, positions, metadata, logits_indices = prepared[1]
            qsl = metadata[0].query_start_loc_cpu
            tokens = [r.all_token_ids[-1] for r in requests]  # each a decode of its newest token
            self.batch_starts = [r.num_computed_tokens for r in requests]
            input_ids = self.buffers.write_input_ids(qsl[: len(requests)], tokens, metadata[0].num_actual_tokens)
            self.num_prepared_ahead += 1
            return requests, order, rows, size, input_ids, positions, metadata, logits_indices
        return self._prepare(so)

    def prepare_ahead(self, in_flight: SchedulerOutput, next_step: SchedulerOutput) -> None:
        """While in_flight's tokens are sampled, the inputs of next_step, a step of decodes whose tokens are the
        ones being sampled (Scheduler.schedule_ahead's guess): everything but those tokens. Not with LoRA (a
        step's adapters are put in slots as it is prepared)."""
        if self.lora_manager is not None:
            return
        num_computed = [
            r.num_computed_tokens + in_flight.num_scheduled_tokens.get(r.request_id, 0)
            for r in next_step.scheduled_requests
        ]
        self.prepared_ahead = (_batch_key(next_step, num_computed), self._prepare(next_step, num_computed))

    def _prepare(self, so: SchedulerOutput, num_computed: list[int] | None = None):
        lora_slots = self._activate_loras(so.scheduled_requests)
        # Decodes first (the LoRA kernels group tokens by adapter themselves, whatever the order).
        order = sorted(
            range(len(so.scheduled_requests)),
            key=lambda i: so.num_scheduled_tokens[so.scheduled_requests[i].request_id] != 1,
        )
        requests = [so.scheduled_requests[i] for i in order]
        num_scheduled = [so.num_scheduled_tokens[r.request_id] for r in requests]
        if num_computed is None:
            num_computed = [r.num_computed_tokens for r in so.scheduled_requests]
        starts = [num_computed[i] for i in order]
        self.batch_starts = starts
        rows = [i for i, (r, start, n) in enumerate(zip(requests, starts, num_scheduled)) if start + n >= r.num_tokens]
        size = self.cudagraphs.padded_size(num_scheduled) if self.cudagraphs is not None else None
        spec = so.scheduled_spec_decode_tokens
        inputs = self.buffers.prepare(
            requests,
            num_scheduled,
            [so.block_ids[r.request_id] for r in requests],
            rows,
            size,
            [spec.get(r.request_id, []) for r in requests] if spec else None,
            starts,
            self._rope_offsets(requests),
        )
        if self.lora_manager is not None:
            self.lora_manager.set_mapping(*self.buffers.prepare_lora([lora_slots[i] for i in order], num_scheduled))
        return requests, order, rows, size, *inputs

    def _rope_offsets(self, requests) -> list[int] | None:
        switch = self.rope_switch_len
        return None if switch is None else [switch if r.num_tokens > switch else 0 for r in requests]

    def _activate_loras(self, requests) -> list[int]:
        """Each request's LoRA slot (-1: the base model), its adapter put in a slot if it was not."""
        if self.lora_manager is None:
            return [-1] * len(requests)
        slot_of, failures = self.lora_manager.activate({r.lora_request.lora_int_id for r in requests if r.lora_request})
        self.lora_failures = {
            r.request_id: RequestFailure.from_exception(r.request_id, "loading its LoRA adapter", failures[lora_id])
            for r in requests
            if r.lora_request and (lora_id := r.lora_request.lora_int_id) in failures
        }
        return [slot_of.get(r.lora_request.lora_int_id, -1) if r.lora_request else -1 for r in requests]

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput, while_waiting=None) -> ModelRunnerOutput:
        """Sampled tokens (and any logprobs) per scheduled request, in so.scheduled_requests order.

        Rows that are mid-prefill get []: they are not sampled, so a seeded request's
        generator advances only when it really emits a token. With speculative decoding a request's drafts are
        verified in this one forward pass (logits at each of its drafts and after them), the rejection sampler
        keeps what the target model agrees with, and the drafter proposes the next drafts. while_waiting (async
        scheduling) is called while the step's tokens are being sampled (as BatchSampler.sample's).
        """
        for request_id in so.finished_req_ids:
            self.prompt_logprobs_in_progress.pop(request_id, None)
            self.pooling_in_progress.pop(request_id, None)
            self.mrope_positions.pop(request_id, None)
        self.sampler.forget(so.finished_req_ids)
        if self.drafter is not None:
            self.drafter.forget(so.finished_req_ids)
        self.device_wait_s = 0.0
        for mm_hash in so.free_encoder_mm_hashes:
            self.encoder_cache.pop(mm_hash, None)
        if so.is_empty:
            return ModelRunnerOutput([])
        if while_waiting is not None:
            while_waiting = partial(self._while_waiting, so, while_waiting)
        requests, order, rows, size, input_ids, positions, metadata, logits_indices = self.prepare_inputs(so)
        mm_inputs = self._multimodal_inputs(so, requests, metadata[0], input_ids)
        if mm_inputs and self.model.config.is_mm_prefix_lm:
            self._set_mm_prefix_range(requests, metadata)
        model_positions = positions
        if getattr(self.model, "uses_mrope", False):
            model_positions = self._mrope_batch_positions(requests, metadata[0], positions.shape[0])
        # A step with image embeddings or M-RoPE runs eagerly (graphs take token ids and 1-D positions).
        if size is None or mm_inputs or model_positions is not positions:
            attn_metadata = layer_metadata(self.model.attn_backend, metadata, self.layer_to_group)
            intermediate = None
            if not is_first_stage():
                shape = (input_ids.shape[0], self.model.config.hidden_size)
                intermediate = recv_from_prev_stage({"hidden_states": shape}, self.dtype, self.device)
            hidden = self.model(input_ids, model_positions, attn_metadata, self.kv_caches, intermediate, **mm_inputs)
        else:
            hidden = self.cudagraphs.replay(size)
        if not is_last_stage():
            send_to_next_stage({"hidden_states": hidden})
            return ModelRunnerOutput([[] for _ in order])
        if self.drafter is not None:
            self.drafter.run_batch(input_ids, positions, metadata[0])  # the draft's KV lives in group 0's blocks
        output = ModelRunnerOutput([[] for _ in order], failed=dict(self.lora_failures), encoder_runs=self.encoder_runs)
        if self.pooler is not None:  # nothing samples: the requests whose prompt is complete are pooled
            if self.is_driver:
                output.pooler_output = self._pool(requests, metadata[0], hidden)
            return output
        prompt_chunks, prompts_done = self._prompt_logprob_chunks(requests, metadata[0], hidden)
        sampled_requests = [requests[i] for i in rows]
        drafts = None
        if so.scheduled_spec_decode_tokens:
            spec = so.scheduled_spec_decode_tokens
            drafts = self.drafter.draft_tokens([spec.get(r.request_id, []) for r in sampled_requests], sampled_requests)
        logits = self.model.compute_logits(hidden[logits_indices]) if rows else None
        if not self.is_driver:
            return output
        sample_started = time.perf_counter()
        sampler_output, prompt_logprobs = self.sampler.sample(
            sampled_requests,
            logits,
            [c for _, c in prompt_chunks],
            grammar_rows(so, sampled_requests, drafts),
            drafts,
            while_waiting,
            so.trace_headers,
        )
        output.sample_s = time.perf_counter() - sample_started
        for (chunks, _), result in zip(prompt_chunks, prompt_logprobs):
            chunks.append(result)
        self._finish_prompt_logprobs(prompts_done, output)
        if sampler_output is None:
            return output
        waited = time.perf_counter()
        sampled = sampler_output.sampled_token_ids.tolist()  # the step's one wait for the device
        self.device_wait_s = time.perf_counter() - waited
        new_token_ids = [[t for t in tokens if t != PLACEHOLDER_TOKEN_ID] if drafts else [tokens] for tokens in sampled]
        for row, tokens in enumerate(new_token_ids):
            if row in sampler_output.failed:
                output.failed[sampled_requests[row].request_id] = sampler_output.failed[row]
            else:
                output.sampled_token_ids[order[rows[row]]] = tokens
        if sampler_output.logprobs is not None:
            self._gather_logprobs(sampler_output, sampled_requests, new_token_ids, drafts, logits.shape[-1], output)
        if self.drafter is not None:
            proposing = [row for row in range(len(sampled_requests)) if row not in sampler_output.failed]
            output.spec_token_ids = self.drafter.propose(
                [sampled_requests[row] for row in proposing], [new_token_ids[row] for row in proposing], so
            )
        return output

    def _pool(self, requests, metadata, hidden) -> dict[str, torch.Tensor]:
        """The pooled vector (on the host) of each request whose prompt completes in this step; the chunks of the
        others are kept where the pooling reads more than the last position."""
        pooled = {}
        keep_chunks = self.pooler.config.needs_all_positions
        for i, request in enumerate(requests):
            q_start, q_end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
            chunk, start = hidden[q_start:q_end], request.num_computed_tokens
            if start == 0:  # its first chunk, or its first again after a preemption
                self.pooling_in_progress.pop(request.request_id, None)
            if start + len(chunk) < request.num_tokens:
                if keep_chunks:  # copied: the next step's forward may write where this one's hidden states are
                    self.pooling_in_progress.setdefault(request.request_id, []).append(chunk.clone())
                continue
            chunks = self.pooling_in_progress.pop(request.request_id, [])
            pooled[request.request_id] = self.pooler(torch.cat([*chunks, chunk]), request.pooling_params).cpu()
        return pooled

    def _multimodal_inputs(self, so: SchedulerOutput, requests, metadata, input_ids) -> dict:
        """{"inputs_embeds": ...} when this step's tokens include image placeholders, else {}: the images the
        scheduler scheduled are encoded first (once each), then each placeholder token in the batch takes its row of
        its image's embeddings (a chunk of a prompt takes the slice of an image it covers), as vLLM's
        merge_multimodal_embeddings."""
        self.encoder_runs = {}
        for request_id, features in so.scheduled_encoder_inputs.items():
            for feature in features:
                if feature.identifier not in self.encoder_cache:
                    started = time.monotonic()
                    self.encoder_cache[feature.identifier] = self.model.get_multimodal_embeddings(feature.data)
                    run = (started, time.monotonic(), feature.num_embeds)
                    self.encoder_runs.setdefault(request_id, []).append(run)
        pieces, rows = [], []
        qsl = metadata.query_start_loc_cpu
        for i, (request, start) in enumerate(zip(requests, self.batch_starts)):
            end = start + int(qsl[i + 1] - qsl[i])
            for feature in request.mm_features:
                lo, hi = max(start, feature.mm_position.offset), min(end, feature.mm_position.end)
                if lo < hi:
                    offset = feature.mm_position.offset
                    pieces.append(self.encoder_cache[feature.identifier][lo - offset : hi - offset])
                    rows.extend(range(int(qsl[i]) + lo - start, int(qsl[i]) + hi - start))
        if not pieces:
            return {}
        embeds = self.model.get_input_embeddings(input_ids)
        embeds[torch.tensor(rows, device=embeds.device)] = torch.cat(pieces).to(embeds.dtype)
        return {"inputs_embeds": embeds}

    def _mrope_batch_positions(self, requests, metadata, num_rows: int) -> torch.Tensor:
        """The batch's M-RoPE positions [3, num_rows]: a prompt token's from its request's image grids, a later
        token's its index plus the request's delta in all three (vLLM's mrope_positions)."""
        out = torch.zeros(3, num_rows, dtype=torch.long)
        qsl = metadata.query_start_loc_cpu
        for i, (request, start) in enumerate(zip(requests, self.batch_starts)):
            if request.request_id not in self.mrope_positions:
                self.mrope_positions[request.request_id] = self.model.get_mrope_input_positions(
                    request.prompt_token_ids, request.mm_features
                )
            prompt, delta = self.mrope_positions[request.request_id]
            q_start, n = int(qsl[i]), int(qsl[i + 1] - qsl[i])
            out[:, q_start : q_start + n] = torch.arange(start + delta, start + delta + n)
            in_prompt = min(start + n, prompt.shape[1]) - start
            if in_prompt > 0:
                out[:, q_start : q_start + in_prompt] = prompt[:, start : start + in_prompt]
        return out.to(self.device, non_blocking=True)

    def _set_mm_prefix_range(self, requests, metadata) -> None:
        """A prefix-LM model (Gemma 3) attends both ways within each image: the positions of each request's images
        that this step's tokens touch, for every KV cache group's attention (vLLM's mm_prefix_range). The scheduler
        never splits an image across steps, so its keys are all there."""
        ranges, qsl = {}, metadata[0].query_start_loc_cpu
        for i, (request, start) in enumerate(zip(requests, self.batch_starts)):
            end = start + int(qsl[i + 1] - qsl[i])
            spans = [(f.mm_position.offset, f.mm_position.end) for f in request.mm_features]
            spans = [(lo, hi) for lo, hi in spans if lo < end and hi > start]
            if spans:
                ranges[i] = spans
        for group_metadata in metadata:
            group_metadata.mm_prefix_range = ranges

    def _while_waiting(self, so: SchedulerOutput, schedule_ahead) -> None:
        """The engine's work for the next step while this one's tokens are sampled: its blocks, then its inputs."""
        next_step = schedule_ahead()
        if next_step is not None:
            self.prepare_ahead(so, next_step)

    @staticmethod
    def _gather_logprobs(sampler_output, sampled_requests, new_token_ids, drafts, vocab: int, output) -> None:
        """Each request's logprobs rows, one per new token (with drafts the sampler's rows are positions)."""
        lp = sampler_output.logprobs
        start = 0
        for row, request in enumerate(sampled_requests):
            k = request.sampling_params.logprobs
            n = len(new_token_ids[row])
            if k is not None and row not in sampler_output.failed:
                k = vocab if k == -1 else k
                output.logprobs[request.request_id] = LogprobsTensors(
                    lp.token_ids[start : start + n, : k + 1].clone(),
                    lp.logprobs[start : start + n, : k + 1].clone(),
                    lp.ranks[start : start + n].clone(),
                )
            start += drafts.num_positions[row] if drafts else 1

    def _prompt_logprob_chunks(self, requests, metadata, hidden):
        """This step's chunk of each prompt that wants logprobs: (the list its results gather in, (logits,
        num_logprobs, the prompt tokens they predict)); and the requests whose prompt is complete."""
        chunks_out, done = [], []
        for i, request in enumerate(requests):
            k = request.sampling_params.prompt_logprobs
            # After a preemption the prompt runs again, but its logprobs were already sent.
            if k is None or request.num_output_tokens > 0:
                continue
            start, q_start = request.num_computed_tokens, metadata.query_start_loc_cpu[i]
            n = metadata.query_start_loc_cpu[i + 1] - q_start
            chunks = self.prompt_logprobs_in_progress.setdefault(request.request_id, [])
            if start == 0:
                chunks.clear()
            # Position p predicts token p + 1; only predictions of prompt tokens count.
            end = min(start + n, request.num_prompt_tokens - 1)
            if end > start:
                logits = self.model.compute_logits(hidden[q_start : q_start + end - start])
                vocab = logits.shape[-1]
                # Built on the host, copied without waiting: a plain torch.tensor(..., device=) waits for the device.
                targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1]).to(self.device, non_blocking=True)
                chunks_out.append((chunks, (logits, vocab if k == -1 else k, targets)))
            if start + n >= request.num_prompt_tokens:
                done.append(request.request_id)
        return chunks_out, done

    def _finish_prompt_logprobs(self, request_ids: list[str], output: ModelRunnerOutput) -> None:
        """Requests whose whole prompt has run: their prompt logprobs, all chunks joined."""
        for request_id in request_ids:
            chunks = self.prompt_logprobs_in_progress.pop(request_id)
            if chunks:
                output.prompt_logprobs[request_id] = LogprobsTensors(
                    *(torch.cat(parts) for parts in zip(*((c.token_ids, c.logprobs, c.ranks) for c in chunks)))
                )


def _batch_key(so: SchedulerOutput, num_computed: list[int]) -> tuple:
    """What a step's prepared inputs depend on: its requests in order, where each starts, its tokens, its blocks."""
    return tuple(
        (r.request_id, start, so.num_scheduled_tokens[r.request_id], tuple(map(tuple, so.block_ids[r.request_id])))
        for r, start in zip(so.scheduled_requests, num_computed)
    )


def grammar_rows(so: SchedulerOutput, sampled_requests, drafts: DraftTokens | None = None) -> GrammarBitmask | None:
    """The scheduler's grammar bitmask rows, for the rows of the step's logits (in sampled_requests order; with
    drafts, a structured request's rows are its verified positions, and so are its bitmask rows)."""
    if so.grammar_bitmask is None:
        return None
    counts = drafts.num_positions if drafts else [1] * len(sampled_requests)
    rows, index, position = [], [], 0
    for request, n in zip(sampled_requests, counts):
        first = so.structured_output_request_ids.get(request.request_id)
        if first is not None:
            rows += range(position, position + n)
            index += range(first, first + n)
        position += n
    return GrammarBitmask(rows, so.grammar_bitmask[index])
