"""ModelRunner: turns a SchedulerOutput into one flat batch, runs the model, samples."""

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata
from engine.sample.sampler import Sampler
from engine.sched.output import SchedulerOutput


class ModelRunner:
    def __init__(self, model, kv_caches, block_size: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        # Seeded requests keep one generator for their whole life.
        self.generators: dict[str, torch.Generator] = {}

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
    def execute_model(self, so: SchedulerOutput) -> list[int | None]:
        """Sampled token per scheduled request, in so.scheduled_requests order.

        Rows that are mid-prefill get None: they are not sampled, so a seeded request's
        generator advances only when it really emits a token.
        """
        for request_id in so.finished_req_ids:
            self.generators.pop(request_id, None)
        if so.is_empty:
            return []
        requests, order, input_ids, positions, metadata, logits_indices = self.prepare_inputs(so)
        hidden = self.model(input_ids, positions, metadata, self.kv_caches)
        rows = [i for i, r in enumerate(requests) if metadata.seq_lens_cpu[i] >= r.num_tokens]
        result: list[int | None] = [None] * len(order)
        if not rows:
            return result
        logits = self.model.compute_logits(hidden[logits_indices[rows]])
        params, generators = [], {}
        for row, i in enumerate(rows):
            request = requests[i]
            params.append(request.sampling_params)
            seed = request.sampling_params.seed
            if seed is not None and not request.sampling_params.greedy:
                if request.request_id not in self.generators:
                    self.generators[request.request_id] = torch.Generator(self.device).manual_seed(seed)
                generators[row] = self.generators[request.request_id]
        sampled = self.sampler(logits, params, generators).tolist()
        for row, i in enumerate(rows):
            result[order[i]] = sampled[row]
        return result
