"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, samples.

It samples in process, or, given a sampler_client (engine.sample.remote.RemoteSampler), on the sampler
service: the same rows and prompt-logprob rows go there, and the same outputs come back.
"""

import logging

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import (LogprobsTensors, Sampler, SamplerOutput, SamplerUnavailableError, compute_logprobs,
                                   gather_logprobs)
from engine.sched.output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("llmmesh.engine")


class ModelRunner:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device, sampler_client=None,
                 sampler_fallback: bool = False):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # Seeded requests keep one generator for their whole life.
        self.generators: dict[str, torch.Generator] = {}
        # Prompt logprobs of requests whose prompt is still being prefilled in chunks.
        self.prompt_logprobs_in_progress: dict[str, list[LogprobsTensors]] = {}
        # The sampler service, when sampling is remote; with sampler_fallback, a step it cannot serve samples here.
        self.sampler_client = sampler_client
        self.sampler_fallback = sampler_fallback

    def prepare_inputs(self, so: SchedulerOutput):
        """The flat super-sequence: every scheduled token of every request, decodes first."""
        bs = self.block_size
        order = sorted(
            range(len(so.scheduled_requests)),
            key=lambda i: so.num_scheduled_tokens[so.scheduled_requests[i].request_id] != 1,
        )
        requests = [so.scheduled_requests[i] for i in order]
        input_ids, positions, slot_mapping = [], [], []
        query_start_loc, seq_lens = [0], []
        max_blocks = max(len(so.block_ids[r.request_id]) for r in requests)
        block_table = np.zeros((len(requests), max_blocks), dtype=np.int64)
        for row, request in enumerate(requests):
            n = so.num_scheduled_tokens[request.request_id]
            start = request.num_computed_tokens
            block_ids = np.asarray(so.block_ids[request.request_id], dtype=np.int64)
            block_table[row, : len(block_ids)] = block_ids
            pos = np.arange(start, start + n)
            input_ids.extend(request.all_token_ids[start : start + n])
            positions.append(pos)
            # slot = block_id * block_size + offset within the block
            slot_mapping.append(block_ids[pos // bs] * bs + pos % bs)
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(start + n)
        num_decodes = sum(1 for r in requests if so.num_scheduled_tokens[r.request_id] == 1)

        dev = self.device
        metadata = AttentionMetadata(
            num_actual_tokens=len(input_ids),
            slot_mapping=torch.from_numpy(np.concatenate(slot_mapping)).to(dev),
            query_start_loc=torch.tensor(query_start_loc, device=dev),
            seq_lens=torch.tensor(seq_lens, device=dev),
            block_table=torch.from_numpy(block_table).to(dev),
            num_decodes=num_decodes,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        input_ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(positions)).to(dev)
        # Only the last position of each request produces logits.
        logits_indices = metadata.query_start_loc[1:] - 1
        return requests, order, input_ids, positions, metadata, logits_indices

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Sampled tokens (and any logprobs) per scheduled request, in so.scheduled_requests order.

        Rows that are mid-prefill get None: they are not sampled, so a seeded request's
        generator advances only when it really emits a token.
        """
        for request_id in so.finished_req_ids:
            self.generators.pop(request_id, None)
            self.prompt_logprobs_in_progress.pop(request_id, None)
        if self.sampler_client is not None:
            self.sampler_client.forget(so.finished_req_ids)
        if so.is_empty:
            return ModelRunnerOutput([])
        requests, order, input_ids, positions, metadata, logits_indices = self.prepare_inputs(so)
        hidden = self.model(input_ids, positions, metadata, self.kv_caches)
        output = ModelRunnerOutput([None] * len(order))
        remote_prompt_chunks, prompts_done = self._compute_prompt_logprobs(requests, metadata, hidden)
        rows = [i for i, r in enumerate(requests) if metadata.seq_lens_cpu[i] >= r.num_tokens]
        sampled_requests = [requests[i] for i in rows]
        logits = self.model.compute_logits(hidden[logits_indices[rows]]) if rows else None
        sampler_output = self._sample(sampled_requests, logits, remote_prompt_chunks)
        self._finish_prompt_logprobs(prompts_done, output)
        if sampler_output is None:
            return output
        for row, token_id in enumerate(sampler_output.sampled_token_ids.tolist()):
            output.sampled_token_ids[order[rows[row]]] = token_id
        if sampler_output.logprobs is not None:
            lp, vocab = sampler_output.logprobs, logits.shape[-1]
            for row, request in enumerate(sampled_requests):
                k = request.sampling_params.logprobs
                if k is not None:
                    k = vocab if k == -1 else k
                    output.logprobs[request.request_id] = LogprobsTensors(
                        lp.token_ids[row : row + 1, : k + 1].clone(),
                        lp.logprobs[row : row + 1, : k + 1].clone(),
                        lp.ranks[row : row + 1].clone(),
                    )
        return output

    def _sample(self, sampled_requests, logits, remote_prompt_chunks) -> SamplerOutput | None:
        """Sample the rows (None without any) and finish the prompt-logprob chunks left for the sampler service."""
        if self.sampler_client is not None:
            try:
                sampler_output, results = self.sampler_client.sample(
                    sampled_requests, logits, [(lg, k, targets) for _, lg, k, targets in remote_prompt_chunks]
                )
            except SamplerUnavailableError as e:
                if not self.sampler_fallback:
                    raise
                logger.warning("%s; sampling this step in process", e)
            else:
                for (chunks, *_), result in zip(remote_prompt_chunks, results):
                    chunks.append(result)
                return sampler_output
        for chunks, lg, k, targets in remote_prompt_chunks:
            chunks.append(gather_logprobs(compute_logprobs(lg), k, targets))
        if logits is None:
            return None
        generators = {}
        for row, request in enumerate(sampled_requests):
            params = request.sampling_params
            if params.seed is not None and not params.greedy:
                if request.request_id not in self.generators:
                    self.generators[request.request_id] = torch.Generator(self.device).manual_seed(params.seed)
                generators[row] = self.generators[request.request_id]
        sampling_metadata = SamplingMetadata.from_requests(sampled_requests, generators, logits.shape[-1], self.device)
        return self.sampler(logits, sampling_metadata)

    def _compute_prompt_logprobs(self, requests, metadata, hidden):
        """Raw logprobs of each prompt token after the first, collected chunk by chunk.

        In process they are computed here; with a sampler service, the chunks' (list to append to, logits,
        num_logprobs, targets) are returned for it. Also returns the requests whose prompt is complete."""
        remote, done = [], []
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
                targets = torch.tensor(request.prompt_token_ids[start + 1 : end + 1], device=self.device)
                if self.sampler_client is None:
                    chunks.append(gather_logprobs(compute_logprobs(logits), vocab if k == -1 else k, targets))
                else:
                    remote.append((chunks, logits, vocab if k == -1 else k, targets))
            if start + n >= request.num_prompt_tokens:
                done.append(request.request_id)
        return remote, done

    def _finish_prompt_logprobs(self, request_ids: list[str], output: ModelRunnerOutput) -> None:
        """Requests whose whole prompt has run: their prompt logprobs, all chunks joined."""
        for request_id in request_ids:
            chunks = self.prompt_logprobs_in_progress.pop(request_id)
            if chunks:
                output.prompt_logprobs[request_id] = LogprobsTensors(
                    *(torch.cat(parts) for parts in zip(*((c.token_ids, c.logprobs, c.ranks) for c in chunks)))
                )
