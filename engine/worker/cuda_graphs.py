"""Persistent input buffers for every step, and CUDA graphs for decode-only steps.

A CUDA graph replays kernels against the device addresses they were captured with, so a step's
inputs must sit at the same addresses every time: they live in buffers allocated once, are filled
on the host (numpy over pinned memory) and copied over without the host waiting for the device.
Eager steps use the same buffers, so there is one way to build a batch.

A decode batch of n requests runs the graph captured for the next size up. Its padding rows write
no KV (slot -1) and attend to nothing (seq_len 0); the graph holds only the model's forward up to
the hidden states, and logits and sampling run eagerly on the real rows.
"""

import bisect
from collections import Counter

import numpy as np
import torch

from engine.attention.backend import AttentionBackend, AttentionMetadata, layer_metadata
from engine.config import EngineArgs, EngineConfig


def use_cudagraphs(config: EngineConfig | EngineArgs, device: torch.device, backend: AttentionBackend) -> bool:
    """Graphs need a CUDA device, a backend whose launches depend only on shapes, and sizes to capture;
    --enforce-eager turns them off, and so does --enable-lora (a step's adapter segments are host data)."""
    if isinstance(config, EngineArgs):  # the flat settings, as a caller without the composed configs has them
        config = config.create_engine_config()
    return (
        device.type == "cuda"
        and not config.model_config.enforce_eager
        and not config.lora_config.enable_lora
        and backend.cudagraph_support
        and bool(config.get_cudagraph_capture_sizes())
    )


class CpuGpuBuffer:
    """One input array: host memory to fill through .np, and its device twin (on CPU, the same), allocated once."""

    def __init__(self, *shape: int, device: torch.device):
        # Pinned, so the copy to the device is a true async DMA that the host does not wait for.
        self.cpu = torch.zeros(shape, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.np = self.cpu.numpy()
        # On CPU the host memory is the device's: nothing to copy.
        self.gpu = self.cpu if device.type == "cpu" else torch.zeros(shape, dtype=torch.int64, device=device)

    def copy_to_gpu(self, n: int) -> torch.Tensor:
        """The first n rows, on the device (a view of the persistent buffer)."""
        if self.gpu is not self.cpu:
            self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.gpu[:n]


class InputBuffers:
    """The flat batch (DESIGN §2) in persistent buffers: input ids, positions, slots, and the attention metadata.

    Each KV cache group (engine.kv.kv_cache_spec) has its own block table and slot mapping, and so its own
    AttentionMetadata; the rest of the metadata is the same for all."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_reqs: int,
        max_blocks_per_req: int,
        block_size: int,
        device: torch.device,
        num_kv_cache_groups: int = 1,
    ):
        self.block_size = block_size
        self.input_ids = CpuGpuBuffer(max_num_tokens, device=device)
        self.positions = CpuGpuBuffer(max_num_tokens, device=device)
        self.slot_mappings = [CpuGpuBuffer(max_num_tokens, device=device) for _ in range(num_kv_cache_groups)]
        self.query_start_loc = CpuGpuBuffer(max_num_reqs + 1, device=device)
        self.seq_lens = CpuGpuBuffer(max_num_reqs, device=device)
        # Rows keep whatever ids an earlier step left past their own blocks: valid block ids, never read.
        self.block_tables = [
            CpuGpuBuffer(max_num_reqs, max_blocks_per_req, device=device) for _ in range(num_kv_cache_groups)
        ]
        # Speculative decoding verifies several positions of a request: up to one logits row per token.
        self.logits_indices = CpuGpuBuffer(max_num_tokens, device=device)
        # Each token's LoRA slot (-1: the base model), vLLM's token_lora_mapping.
        self.token_lora_indices = CpuGpuBuffer(max_num_tokens, device=device)
        # Recorded after each step's copies; the next step waits on it before overwriting the host side.
        self.copied = torch.cuda.Event() if device.type == "cuda" else None

    def prepare(
        self,
        requests,
        num_scheduled: list[int],
        block_ids: list[list[list[int]]],
        sampled_rows: list[int],
        pad_to: int | None = None,
        spec_token_ids: list[list[int]] | None = None,
        num_computed: list[int] | None = None,
        rope_offsets: list[int] | None = None,
    ):
        """Fill the buffers with these requests' scheduled tokens, in order, and start the copies to the device.

        With pad_to (a decode-only batch for a CUDA graph), rows len(requests)..pad_to are padding: one
        token each, id 0 at position 0, slot -1, seq_len 0. block_ids: each request's block ids in each KV cache
        group. Returns input_ids, positions, the attention metadata (one per group), and logits_indices: where the
        last token of each of sampled_rows sits in the flat batch.

        spec_token_ids: each request's drafts (speculative decoding), the last of its scheduled tokens; the
        logits of a sampled row are then its last 1 + len(drafts) positions, each verifying the next.

        num_computed: where each request's scheduled tokens start, when not yet its num_computed_tokens (a batch
        prepared while the step before it samples); its tokens not yet sampled are left for write_input_ids.

        rope_offsets: added to each request's positions as the model sees them (not to its slots): the row of its
        rope table (LongRoPERotaryEmbedding's long half for a request past the switch length).
        """
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies are done reading the host side (normally long since)
        num_reqs, bs = len(requests), self.block_size
        num_rows = pad_to or num_reqs
        n = np.ones(num_rows, dtype=np.int64)
        n[:num_reqs] = num_scheduled
        starts = np.zeros(num_rows, dtype=np.int64)
        starts[:num_reqs] = num_computed if num_computed is not None else [r.num_computed_tokens for r in requests]
        qsl = self.query_start_loc.np[: num_rows + 1]
        qsl[0] = 0
        np.cumsum(n, out=qsl[1:])
        num_real, total = int(qsl[num_reqs]), int(qsl[num_rows])
        seq_lens = self.seq_lens.np[:num_rows]
        seq_lens[:] = starts + n
        seq_lens[num_reqs:] = 0

        input_ids = self.input_ids.np
        for row, (request, group_ids) in enumerate(zip(requests, block_ids)):
            for table, ids in zip(self.block_tables, group_ids):
                table.np[row, : len(ids)] = ids
            drafts = spec_token_ids[row] if spec_token_ids else ()
            end = qsl[row + 1] - len(drafts)
            ids = request.all_token_ids[starts[row] : starts[row] + n[row] - len(drafts)]
            input_ids[qsl[row] : qsl[row] + len(ids)] = ids
            input_ids[end : qsl[row + 1]] = drafts
        input_ids[num_real:total] = 0
        rows = np.repeat(np.arange(num_rows), n)
        positions = self.positions.np[:total]
        positions[:] = np.arange(total) - qsl[rows] + starts[rows]
        # slot = block_id * block_size + offset within the block
        for table, slot_mapping in zip(self.block_tables, self.slot_mappings):
            slots = slot_mapping.np[:total]
            slots[:] = table.np[rows, positions // bs] * bs + positions % bs
            slots[num_real:] = -1
        if rope_offsets is not None:
            positions[:num_real] += np.repeat(rope_offsets, n[:num_reqs])
        num_logits = np.ones(len(sampled_rows), dtype=np.int64)
        if spec_token_ids:
            num_logits += [len(spec_token_ids[row]) for row in sampled_rows]
        num_logits_total = int(num_logits.sum())
        first = np.repeat(qsl[1:][sampled_rows] - num_logits, num_logits)
        offset = np.arange(num_logits_total) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)
        self.logits_indices.np[:num_logits_total] = first + offset

        query_start_loc, seq_lens_gpu = (
            self.query_start_loc.copy_to_gpu(num_rows + 1),
            self.seq_lens.copy_to_gpu(num_rows),
        )
        num_decodes = int(np.count_nonzero(n == 1))  # rows are ordered decodes first
        qsl_cpu, seq_lens_cpu = qsl.tolist(), seq_lens.tolist()
        metadata = [
            AttentionMetadata(
                num_actual_tokens=total,
                slot_mapping=slot_mapping.copy_to_gpu(total),
                query_start_loc=query_start_loc,
                seq_lens=seq_lens_gpu,
                block_table=table.copy_to_gpu(num_rows),
                num_decodes=num_decodes,
                query_start_loc_cpu=qsl_cpu,
                seq_lens_cpu=seq_lens_cpu,
            )
            for table, slot_mapping in zip(self.block_tables, self.slot_mappings)
        ]
        input_ids, positions = self.input_ids.copy_to_gpu(total), self.positions.copy_to_gpu(total)
        logits_indices = self.logits_indices.copy_to_gpu(num_logits_total)
        if self.copied is not None:
            self.copied.record()
        return input_ids, positions, metadata, logits_indices

    def write_input_ids(self, flat_positions: list[int], token_ids: list[int], total: int) -> torch.Tensor:
        """Tokens into their places in the prepared batch of `total` tokens (those that were being sampled while
        it was prepared); its input ids on the device."""
        if self.copied is not None:
            self.copied.synchronize()
        self.input_ids.np[flat_positions] = token_ids
        input_ids = self.input_ids.copy_to_gpu(total)
        if self.copied is not None:
            self.copied.record()
        return input_ids

    def prepare_lora(self, lora_slots: list[int], num_scheduled: list[int]) -> tuple[torch.Tensor, np.ndarray]:
        """Each scheduled token's LoRA slot, from its request's (after prepare(), in the same order): on the device,
        and the host array it was copied from."""
        total = sum(num_scheduled)
        host = self.token_lora_indices.np[:total]
        host[:] = np.repeat(lora_slots, num_scheduled)
        return self.token_lora_indices.copy_to_gpu(total), host


class CUDAGraphs:
    """One graph per capture size: the model's forward over the first `size` rows of the input buffers."""

    def __init__(self, model, kv_caches, buffers: InputBuffers, sizes: list[int], layer_to_group: list[int]):
        self.model, self.kv_caches, self.buffers = model, kv_caches, buffers
        self.sizes = sizes
        self.layer_to_group = layer_to_group  # each layer's KV cache group
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays: Counter[int] = Counter()  # size -> steps that ran its graph
        # Outside the graphs' pool, at one address: each graph copies its hidden states here.
        weight = model.norm.weight  # in the model's dtype whatever its layers' quantization
        self.hidden = torch.zeros(max(sizes), model.config.hidden_size, dtype=weight.dtype, device=weight.device)

    def padded_size(self, num_scheduled: list[int]) -> int | None:
        """The captured size this batch runs as, or None: not decode-only, or larger than every graph."""
        if any(n != 1 for n in num_scheduled):
            return None
        i = bisect.bisect_left(self.sizes, len(num_scheduled))
        return self.sizes[i] if i < len(self.sizes) else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest first, so the smaller graphs fit in the memory pool the largest one made."""
        pool = None
        for size in reversed(self.sizes):
            input_ids, positions, metadata, _ = self.buffers.prepare([], [], [], [], pad_to=size)
            # Prepared outside the graph: a backend that captures (Triton) does nothing there.
            metadata = layer_metadata(self.model.attn_backend, metadata, self.layer_to_group)
            # Once eagerly first: lazy set-up (cuBLAS handles, Triton compilation) must not happen under capture.
            self.hidden[:size] = self.model(input_ids, positions, metadata, self.kv_caches)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:size] = self.model(input_ids, positions, metadata, self.kv_caches)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of this size on what prepare() left in the buffers; the hidden states of all its rows."""
        self.graphs[size].replay()
        self.replays[size] += 1
        return self.hidden[:size]
