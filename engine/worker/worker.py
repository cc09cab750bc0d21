"""Worker: owns the device and what lives on it (the model, the KV cache tensors, the ModelRunner).

vLLM's split: the engine core decides what to run; the worker sizes and allocates the KV cache
(load_model, determine_num_available_blocks, initialize_kv_cache, which also captures the CUDA graphs)
and runs each step (execute_model).
"""

import functools
import logging
import os
import time
from pathlib import Path

import torch

from engine.attention.backend import AttentionMetadata, layer_metadata, resolve_kv_cache_dtype
from engine.attention.mla import mla_kv_cache_shape
from engine.attention.selector import get_attn_backend
from engine.config import EngineConfig, parse_memory_size
from engine.distributed.parallel_state import (
    destroy_distributed,
    get_pp_rank,
    get_pp_size,
    get_tp_rank,
    get_tp_size,
    is_first_stage,
    is_last_stage,
)
from engine.kv.connector.base import KVConnectorBase, KVConnectorRole
from engine.kv.connector.factory import create_connector
from engine.kv.kv_cache_spec import (
    MLAAttentionSpec,
    SlidingWindowSpec,
    kv_cache_groups,
    layer_to_group,
    layer_to_tensor,
)
from engine.kv.layout import KVLayout, block_shape, model_fingerprint, weights_digest
from engine.kv.manager import cdiv
from engine.lora.manager import LoRAModelManager
from engine.lora.request import LoRARequest
from engine.malloc import keep_freed_memory_in_process
from engine.models.config import MULTIMODAL_ARCHS, ModelArchConfig
from engine.models.linear import process_weights_after_loading
from engine.models.loader import check_dtype, dtype_reason, load_weights, prepare_quantized_weights
from engine.models.quantization import QUANTIZED_AT_LOAD, check_quantization, resolve_quantization
from engine.models.registry import ModelRegistry
from engine.models.utils import get_pp_indices
from engine.pooling.config import get_pooler_config
from engine.pooling.pooler import Pooler
from engine.request import Request, SamplingParams
from engine.sample.factory import remote_sampler_class
from engine.sample.metadata import SamplingMetadata
from engine.sample.sampler import BatchSampler, LocalSampler, Sampler
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.spec_decode.draft_model import DraftModelProposer
from engine.spec_decode.ngram_proposer import NgramProposer
from engine.worker.cuda_graphs import use_cudagraphs
from engine.worker.model_runner import ModelRunner

DEFAULT_CPU_KV_CACHE_MEMORY = "2GiB"
GiB = 2**30

logger = logging.getLogger("llmmesh.engine")


def resolve_device(device: str, rank: int = 0, world_size: int = 1) -> torch.device:
    """--device (auto: cuda when there is one); with tensor parallelism on CUDA, this rank's device on its host
    ($LOCAL_RANK, else the rank)."""
    device = device if device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and world_size > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    return torch.device(device)


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelArchConfig, model_dir: Path, max_model_len: int):
        """With tensor parallelism, built once this process joined the group (engine.distributed): the model's
        layers and the KV cache take this rank's shard. model_config is the checkpoint's architecture; the settings
        it runs with are config.model_config."""
        self.config = config
        self.cache_config, self.scheduler_config = config.cache_config, config.scheduler_config
        settings = config.model_config
        self.model_config = model_config
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        pooler_config = get_pooler_config(
            settings.runner, settings.pooler_config, model_config.has_lm_head, model_config.hidden_size, model_dir
        )
        self.pooler = Pooler(pooler_config) if pooler_config is not None else None  # --runner pooling
        self.rank, self.world_size = get_tp_rank(), get_tp_size()
        self.pp_rank, self.pp_size = get_pp_rank(), get_pp_size()
        global_rank = self.pp_rank * self.world_size + self.rank
        self.device = resolve_device(settings.device, global_rank, self.world_size * self.pp_size)
        # This pipeline stage's layers (all of them without pipeline parallelism): it caches K and V for these only.
        self.start_layer, self.end_layer = get_pp_indices(model_config.num_hidden_layers, self.pp_rank, self.pp_size)
        self.num_kv_heads = model_config.num_key_value_heads // self.world_size  # this rank's, in its KV cache
        self.dtype = check_dtype(settings.dtype, self.device.type)
        self.quantization = resolve_quantization(
            settings.quantization, model_config.quantization, model_config.architecture
        )
        check_quantization(self.quantization, self.dtype, self.device)
        logger.info(
            "Computing in %s (%s); quantization: %s",
            str(self.dtype).removeprefix("torch."),
            dtype_reason(settings.dtype, self.device, self.dtype),
            self.quantization or "none",
        )
        if self.device.type == "cpu":
            keep_freed_memory_in_process()
        torch.manual_seed(settings.seed)
        self.attn_backend = get_attn_backend(
            settings.attention_backend,
            self.cache_config.block_size,
            self.device.type,
            model_config.attention_features(),
        )
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.cache_config.kv_cache_dtype, self.dtype)
        self.attn_backend.check_kv_cache_dtype(self.kv_cache_dtype, self.device)
        # The layers grouped by what they keep in the KV cache: the groups share group_size K/V tensors, of which
        # this stage allocates those its layers use.
        self.kv_cache_groups = kv_cache_groups(model_config)
        self.layer_to_tensor = layer_to_tensor(self.kv_cache_groups)[self.start_layer : self.end_layer]
        self.num_kv_tensors = len(set(self.layer_to_tensor))
        # Multi-head latent attention's one latent vector a token (its spec), or None: K and V per head.
        spec = self.kv_cache_groups[0].spec
        self.mla_spec = spec if isinstance(spec, MLAAttentionSpec) else None
        if self.mla_spec is not None and config.lora_config.enable_lora:
            raise ValueError(
                f"--enable-lora is not implemented for {model_config.architecture}'s multi-head latent attention"
            )
        if model_config.architecture in MULTIMODAL_ARCHS:
            for flag, used in (
                ("--enable-lora", config.lora_config.enable_lora),
                ("--pipeline-parallel-size > 1", config.parallel_config.pipeline_parallel_size > 1),
            ):
                if used:
                    raise ValueError(f"{flag} is not implemented for {model_config.architecture}")
        self.model: torch.nn.Module | None = None  # the architecture's class in engine/models/, from ModelRegistry
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.model_runner: ModelRunner | None = None
        self.lora_manager: LoRAModelManager | None = None  # with --enable-lora, once the model is loaded
        self.connector: KVConnectorBase | None = None  # the worker's half of the KV connector, with the KV cache
        # With tensor parallelism every rank runs every step eagerly (no collectives are captured in graphs).
        self.use_cudagraphs = self.world_size == self.pp_size == 1 and use_cudagraphs(
            config, self.device, self.attn_backend
        )
        if self.device.type == "cuda" and self.cache_config.kv_cache_memory is None:
            self._snapshot_gpu_memory()

    def _snapshot_gpu_memory(self) -> None:
        """Device memory before the model is loaded: what profiling measures this engine's use against.

        Like vLLM, --gpu-memory-utilization is this engine's share of the whole device; memory other
        processes (or this one, before the engine) already use is not ours to count, but must leave that share free."""
        torch.cuda.empty_cache()
        self.free_at_start, self.total_memory = torch.cuda.mem_get_info(self.device)
        self.torch_reserved_at_start = torch.cuda.memory_reserved(self.device)
        self.torch_allocated_at_start = torch.cuda.memory_allocated(self.device)
        wanted = self.cache_config.gpu_memory_utilization * self.total_memory
        if self.free_at_start < wanted:
            raise ValueError(
                f"Free device memory ({self.free_at_start / GiB:.2f} of {self.total_memory / GiB:.2f} GiB) is less than "
                f"--gpu-memory-utilization {self.cache_config.gpu_memory_utilization} asks for ({wanted / GiB:.2f} GiB): "
                "something else uses the device. Lower --gpu-memory-utilization or free the device."
            )

    def load_model(self) -> None:
        with torch.device(self.device):
            model_cls = ModelRegistry.resolve_model_cls(self.model_config.architecture)
            model = model_cls(self.model_config, self.attn_backend, self.quantization)
        weights_dir, dequantized = self.model_dir, self.quantization != self.model_config.quantization
        if self.quantization in QUANTIZED_AT_LOAD:  # quantized once (a GGUF's dequantized tensors too), then cached
            weights_dir = prepare_quantized_weights(
                self.model_dir, self.quantization, self.model_config, self.config.model_config.download_dir
            )
            dequantized = False
        model.load_weights(load_weights(weights_dir, dequantized=dequantized))
        process_weights_after_loading(model, self.dtype, self.config.model_config.batch_invariant == "on")
        self.model = model.eval()
        self.drafter = self._make_drafter()  # speculative decoding's proposer: a draft model loads here
        if self.device.type == "cpu":
            try:
                from kernels.cpu_ops import load  # builds the kernels if setup did not

                self.model.use_cpu_ops(load())
            except Exception as e:  # noqa: BLE001 (a machine that cannot build them still runs, on torch ops)
                logger.warning("The C++ CPU kernels are unavailable (%s); the model's layers run on torch ops", e)
        lora = self.config.lora_config
        if lora.enable_lora:  # wraps the loaded layers
            self.lora_manager = LoRAModelManager(
                self.model,
                self.model_config,
                lora.max_loras,
                lora.max_lora_rank,
                lora.max_cpu_loras or lora.max_loras,
                lora.lora_dtype,
            )

    def add_lora(self, lora_request: LoRARequest) -> bytes:
        """Read and check an adapter into host memory; the digest of its weights."""
        return self.lora_manager.add_adapter(lora_request).digest

    def remove_lora(self, lora_int_id: int) -> None:
        self.lora_manager.remove_adapter(lora_int_id)

    def get_cache_block_size_bytes(self) -> int:
        """K and V of one block across the layers of a KV cache group (a block id belongs to one group at a time):
        every layer where the model has one kind of layer (of this pipeline stage's). With MLA, one latent vector a
        token and layer instead, whole on every tensor-parallel rank."""
        cfg = self.model_config
        element = self.kv_cache_dtype.itemsize
        num_layers = self.num_kv_tensors
        if self.mla_spec is not None:
            return num_layers * self.cache_config.block_size * self.mla_spec.head_size * element
        return 2 * num_layers * self.cache_config.block_size * self.num_kv_heads * cfg.head_dim * element

    def _allocate_kv_caches(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The K/V tensor pairs of num_blocks blocks that the groups share (group_size of them, those this
        pipeline stage's layers use): each of the stage's layers' (K, V) is the pair of its place in its group.
        With MLA a layer has one latent tensor in place of the pair."""
        cfg, bs = self.model_config, self.cache_config.block_size
        if self.mla_spec is not None:
            shape = mla_kv_cache_shape(num_blocks, bs, self.mla_spec.head_size)
            latents = {
                i: torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device) for i in set(self.layer_to_tensor)
            }
            return [latents[i] for i in self.layer_to_tensor]
        shape = self.attn_backend.get_kv_cache_shape(num_blocks, bs, self.num_kv_heads, cfg.head_dim)
        pairs = {
            i: (
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
                torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device),
            )
            for i in set(self.layer_to_tensor)
        }
        return [pairs[i] for i in self.layer_to_tensor]

    def determine_num_available_blocks(self) -> int:
        """How many KV blocks fit: the configured budget, or on a GPU what profiling leaves free."""
        if self.device.type == "cuda" and self.cache_config.kv_cache_memory is None:
            budget = self._profile_gpu_kv_budget()
        else:
            budget = parse_memory_size(self.cache_config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY)
        # A draft model keeps its own KV in the same blocks: the budget pays for both.
        block_bytes = self.get_cache_block_size_bytes() + (self.drafter.kv_cache_block_bytes if self.drafter else 0)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"The KV cache budget ({budget} bytes) holds no block of {block_bytes} bytes; "
                "raise --kv-cache-memory or --gpu-memory-utilization."
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_gpu_kv_budget(self) -> int:
        """vLLM's method: this engine's share of the device, less what everything but the KV cache needs.

        That is the weights and the peak activations of the largest step and of sampling max_num_seqs rows
        (torch's allocator, measured by running them), memory allocated outside torch's allocator (cuBLAS
        workspaces, kernel modules: the growth of the device's used memory that torch did not reserve), and
        the model runner with its CUDA graphs (measured by making one over a throwaway cache: the real graphs
        must be captured against the real cache, which is sized from this)."""
        cfg, bs, dev = self.model_config, self.cache_config.block_size, self.device
        torch.cuda.reset_peak_memory_stats(dev)  # from here: loading's temporaries (float32 weights) are gone
        n = min(self.scheduler_config.max_num_batched_tokens, self.max_model_len)
        caches = self._allocate_kv_caches(cdiv(n, bs))
        cache_bytes = cdiv(n, bs) * self.get_cache_block_size_bytes()
        metadata = AttentionMetadata(
            num_actual_tokens=n,
            slot_mapping=torch.arange(n, device=dev),
            query_start_loc=torch.tensor([0, n], device=dev),
            seq_lens=torch.tensor([n], device=dev),
            block_table=torch.arange(cdiv(n, bs), device=dev)[None, :],
            num_decodes=0,
            query_start_loc_cpu=[0, n],
            seq_lens_cpu=[n],
        )
        # Every group's block table is the same here: the throwaway cache holds one request's blocks.
        metadata = layer_metadata(self.attn_backend, [metadata], [0] * len(caches))
        # A pipeline stage after the first starts from hidden states (the shape of those it receives).
        intermediate = (
            None
            if is_first_stage()
            else {"hidden_states": torch.zeros(n, cfg.hidden_size, dtype=self.dtype, device=dev)}
        )
        ids, positions = torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev)
        hidden = self.model(ids, positions, metadata, caches, intermediate)
        if is_last_stage():
            logits = self.model.compute_logits(hidden[-min(n, self.scheduler_config.max_num_seqs) :])
            # Sampling every row at its costliest (penalties, a top-p sort, logprobs): float32 copies of the logits.
            params = SamplingParams(presence_penalty=0.5, repetition_penalty=1.1, top_p=0.9, logprobs=1)
            dummy = [Request(str(i), [0], params) for i in range(len(logits))]
            Sampler()(logits, SamplingMetadata.from_requests(dummy, {}, logits.shape[-1], dev))
            del logits
        torch.cuda.synchronize()
        del hidden, intermediate
        weights_and_activations = torch.cuda.max_memory_allocated(dev) - self.torch_allocated_at_start - cache_bytes
        free, _ = torch.cuda.mem_get_info(dev)
        torch_growth = torch.cuda.memory_reserved(dev) - self.torch_reserved_at_start
        outside_torch = max(0, self.free_at_start - free - torch_growth)
        # Capturing empties torch's cache (torch.cuda.graph does): empty it first, or that would count against the graphs.
        torch.cuda.empty_cache()
        runner, runner_bytes = self._make_model_runner(caches)
        del runner, caches
        torch.cuda.empty_cache()
        share = int(self.total_memory * self.cache_config.gpu_memory_utilization)
        budget = share - weights_and_activations - outside_torch - runner_bytes
        summary = (
            f"--gpu-memory-utilization {self.cache_config.gpu_memory_utilization} of {self.total_memory / GiB:.2f} GiB is "
            f"{share / GiB:.2f} GiB: weights and peak activations take {weights_and_activations / GiB:.2f} GiB, "
            f"memory outside torch's allocator {outside_torch / GiB:.2f} GiB, the runner's input buffers and CUDA "
            f"graphs {runner_bytes / GiB:.2f} GiB, "
            f"leaving {budget / GiB:.2f} GiB for the KV cache"
        )
        logger.info("%s", summary)
        if budget < self.get_cache_block_size_bytes():
            raise ValueError(
                f"No device memory left for the KV cache: {summary}. Raise --gpu-memory-utilization, or lower "
                "--max-num-batched-tokens (peak activations) or --max-num-seqs (CUDA graphs), or pass --enforce-eager."
            )
        return budget

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's K and V cache (views of the tensors the KV cache groups share), then the runner
        that reads and writes them."""
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self.connector = self._make_kv_connector()
        self.model_runner, _ = self._make_model_runner(self.kv_caches, self._make_sampler())
        self.model_runner.drafter = self.drafter
        if isinstance(self.drafter, DraftModelProposer):
            self.drafter.initialize_kv_cache(num_blocks)

    def _make_drafter(self) -> NgramProposer | DraftModelProposer | None:
        """Speculative decoding's proposer (--speculative-config), or None. A draft model is loaded here."""
        config = self.config.speculative_config
        if config is None:
            return None
        if config.method == "ngram":
            return NgramProposer(config)
        vocab = self.model_config.vocab_size
        drafter = DraftModelProposer(config, vocab, self.config, self.device, self.dtype, self.attn_backend)
        if drafter.config.kv_lora_rank is not None:
            raise ValueError(
                f"speculative_config.model: a draft model with multi-head latent attention "
                f"({drafter.config.architecture}) is not implemented; its KV cache is allocated as per-head K and V"
            )
        # The draft's KV lives in the first group's blocks: a sliding group keeps only its window of them.
        spec = self.kv_cache_groups[0].spec
        if isinstance(spec, SlidingWindowSpec):
            windows = [drafter.config.layer_sliding_window(i) for i in range(drafter.config.num_hidden_layers)]
            if any(w is None or w > spec.sliding_window for w in windows):
                raise ValueError(
                    f"speculative_config.model: every layer of the target model attends in a sliding window of "
                    f"{spec.sliding_window} tokens, so its KV cache keeps no more; the draft model's layers need more "
                    f"(their windows: {windows}, None: the whole context)."
                )
        return drafter

    def _make_sampler(self) -> BatchSampler:
        """In process, or on the sampler service at --sampler-address (falling back here with --sampler-fallback; the
        logits in shared memory when the service is on this host)."""
        local = LocalSampler(self.device)
        sampler = self.config.sampler_config
        if not sampler.sampler_address:
            return local
        num_spec = spec.num_speculative_tokens if (spec := self.config.speculative_config) else 0
        return remote_sampler_class()(
            sampler.sampler_address,
            sampler.sampler_timeout,
            fallback=local if sampler.sampler_fallback else None,
            # A step's logits at most, float32 (the widest logits dtype): the size of a shared-memory slot. With
            # speculative decoding a request has a row for each draft and one after them.
            slot_bytes=self.scheduler_config.max_num_seqs * (1 + num_spec) * self.model_config.vocab_size * 4,
            device=self.device,
        )

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
        if self.model_runner is not None:
            self.model_runner.sampler.close()
        if self.world_size * self.pp_size > 1:
            destroy_distributed()

    def _make_model_runner(self, kv_caches, sampler: BatchSampler | None = None) -> tuple[ModelRunner, int]:
        """A runner over these caches, with its CUDA graphs captured if they are used; and the device memory it took."""
        cache, sched, dev = self.cache_config, self.scheduler_config, self.device
        free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0
        runner = ModelRunner(
            self.model,
            kv_caches,
            cache.block_size,
            dev,
            sched.max_num_batched_tokens,
            sched.max_num_seqs,
            self.max_model_len,
            sampler,
            self.lora_manager,
            # The last pipeline stage's first tensor-parallel rank samples (rank 0 without pipeline parallelism).
            is_driver=self.rank == 0 and is_last_stage(),
            layer_to_group=layer_to_group(self.kv_cache_groups)[self.start_layer : self.end_layer],
            pooler=self.pooler,
            dtype=self.dtype,
        )
        if self.use_cudagraphs:
            began, sizes = time.perf_counter(), self.config.get_cudagraph_capture_sizes()
            runner.capture_cudagraphs(sizes)
            logger.info(
                "Captured %d CUDA graphs (decode batches of %s) in %.1f s",
                len(sizes),
                sizes,
                time.perf_counter() - began,
            )
        return runner, (free - torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else 0)

    @functools.cached_property
    def kv_layouts(self) -> list[KVLayout]:
        """What one KV block of each KV cache group is, for a KV connector: [the group's layers, 2, kv heads, block
        size, head dim] (with MLA [the group's layers, block size, latent size]) and a fingerprint of everything that
        makes blocks interchangeable between engines, the group (its index, spec and layers) included. MLA's latents
        are whole on every tensor-parallel rank: the ranks share one fingerprint, and a block is stored once."""
        cfg = self.model_config
        dtype = str(self.kv_cache_dtype).removeprefix("torch.")
        # The same checkpoint quantized another way, or computing in another dtype, computes other K and V values.
        compute = str(self.dtype).removeprefix("torch.")
        weights = f"{weights_digest(self.model_dir)}/{self.quantization or 'unquantized'}/{compute}"
        layouts = []
        for g, group in enumerate(self.kv_cache_groups):
            shape = block_shape(
                group.spec, len(group.layer_ids), self.num_kv_heads, self.cache_config.block_size, cfg.head_dim
            )
            shards = tuple(
                model_fingerprint(
                    weights,
                    dtype,
                    self.attn_backend.name,
                    shape,
                    self.cache_config.prefix_caching_hash_algo,
                    rank,
                    self.world_size,
                    g,
                    group.spec,
                    group.layer_ids,
                )
                for rank in range(1 if self.mla_spec is not None else self.world_size)
            )
            shard_fingerprints = shards if len(shards) > 1 else ()
            fingerprint = shards[0] if self.mla_spec is not None else shards[self.rank]
            layouts.append(KVLayout(fingerprint, dtype, shape, shard_fingerprints, g, group.spec, group.layer_ids))
        return layouts

    def _make_kv_connector(self) -> KVConnectorBase | None:
        """The worker's half of the connector --kv-transfer-config names, over this worker's KV cache."""
        config = self.config.kv_transfer_config
        if config is None:
            return None
        connector = create_connector(config, KVConnectorRole.WORKER, self.kv_layouts)
        connector.register_kv_caches(self.kv_caches)
        return connector

    def execute_model(self, scheduler_output: SchedulerOutput, while_waiting=None) -> ModelRunnerOutput:
        meta = scheduler_output.kv_connector_metadata
        if self.connector is not None:
            self.connector.start_load_kv(meta)
        output = self.model_runner.execute_model(scheduler_output, while_waiting)
        if self.connector is not None:
            self.connector.wait_for_save(meta)
            # With nothing to run, wait briefly for a transfer to end instead of spinning.
            output.kv_connector_output = self.connector.get_finished(wait_s=0.01 if scheduler_output.is_empty else 0.0)
        return output
