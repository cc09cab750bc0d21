"""Worker: owns the device and what lives on it (the model, the KV cache tensors, the ModelRunner).

vLLM's split: the engine core decides what to run; the worker sizes and allocates the KV cache
(load_model, determine_num_available_blocks, initialize_kv_cache) and runs each step (execute_model).
"""

from pathlib import Path

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.selector import get_attn_backend
from engine.config import EngineArgs, parse_memory_size
from engine.kv.manager import cdiv
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import check_dtype, load_weights
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner

DEFAULT_CPU_KV_CACHE_MEMORY = "2GiB"


class Worker:
    def __init__(self, args: EngineArgs, model_config: ModelConfig, model_dir: Path, max_model_len: int):
        self.args = args
        self.model_config = model_config
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.device = torch.device(
            args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = check_dtype(args.dtype, self.device.type)
        torch.manual_seed(args.seed)
        self.attn_backend = get_attn_backend(args.attention_backend, args.block_size, self.device.type)
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.model_runner: ModelRunner | None = None
        self.connector = None  # the worker side of a KV connector, set by the engine core

    def load_model(self) -> None:
        with torch.device(self.device):
            model = LlamaForCausalLM(self.model_config, self.attn_backend)
        model.load_weights(load_weights(self.model_dir))
        self.model = model.to(self.dtype).eval()

    def get_cache_block_size_bytes(self) -> int:
        """K and V of one block across every layer."""
        cfg = self.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.args.block_size * cfg.num_key_value_heads * cfg.head_dim * element

    def determine_num_available_blocks(self) -> int:
        """How many KV blocks fit: the configured budget, or on a GPU what profiling leaves free."""
        if self.device.type == "cuda" and self.args.kv_cache_memory is None:
            budget = self._profile_gpu_kv_budget()
        else:
            budget = parse_memory_size(self.args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY)
        block_bytes = self.get_cache_block_size_bytes()
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(
                f"The KV cache budget ({budget} bytes) holds no block of {block_bytes} bytes; "
                "raise --kv-cache-memory or --gpu-memory-utilization."
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_gpu_kv_budget(self) -> int:
        """vLLM's method: run the largest step once, keep what the model and its peak activations need."""
        cfg, bs, dev = self.model_config, self.args.block_size, self.device
        n = min(self.args.max_num_batched_tokens, self.max_model_len)
        shape = self.attn_backend.get_kv_cache_shape(cdiv(n, bs), bs, cfg.num_key_value_heads, cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=dev),) * 2 for _ in range(cfg.num_hidden_layers)]
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
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        hidden = self.model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), metadata, caches)
        self.model.compute_logits(hidden[-min(n, self.args.max_num_seqs) :])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del caches, hidden
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(dev).total_memory
        return int(total * self.args.gpu_memory_utilization) - peak

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every layer's K and V cache, then the runner that reads and writes them."""
        cfg, bs = self.model_config, self.args.block_size
        shape = self.attn_backend.get_kv_cache_shape(num_blocks, bs, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]
        sampler_client = None
        if self.args.sampler_address:
            from engine.sample.remote import RemoteSampler  # noqa: PLC0415 (gRPC only for a remote sampler)

            sampler_client = RemoteSampler(self.args.sampler_address, self.args.sampler_timeout)
        self.model_runner = ModelRunner(self.model, self.kv_caches, bs, self.device, sampler_client,
                                        self.args.sampler_fallback)

    def kv_layout(self):
        """What one KV block is, for a KV connector: [layers, 2, kv heads, block size, head dim] and a
        fingerprint of everything that makes blocks interchangeable between engines."""
        from engine.kv.connector.kvstore_client import KVLayout, model_fingerprint, weights_digest  # noqa: PLC0415

        cfg = self.model_config
        dtype = str(self.dtype).removeprefix("torch.")
        shape = (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, self.args.block_size, cfg.head_dim)
        fingerprint = model_fingerprint(
            weights_digest(self.model_dir), dtype, self.attn_backend.name, shape, self.args.prefix_caching_hash_algo
        )
        return KVLayout(fingerprint, dtype, shape)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        meta = scheduler_output.kv_connector_metadata
        if self.connector is not None:
            self.connector.start_load_kv(meta)
        output = self.model_runner.execute_model(scheduler_output)
        if self.connector is not None:
            self.connector.wait_for_save(meta)
            # With nothing to run, wait briefly for a transfer to end instead of spinning.
            output.kv_connector_output = self.connector.get_finished(wait_s=0.01 if scheduler_output.is_empty else 0.0)
        return output
