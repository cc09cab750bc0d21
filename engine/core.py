"""EngineCore: the model, the KV cache and the scheduler, advanced one step at a time."""

import logging
import time

import torch

from engine.attention.backend import get_attn_backend
from engine.config import EngineArgs, parse_memory_size
from engine.kv.manager import KVCacheManager, cdiv
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import check_dtype, load_config, load_weights, prepare_model_dir
from engine.request import Request, RequestStatus, SamplingParams
from engine.sched.output import EngineCoreOutput
from engine.sched.scheduler import Scheduler
from engine.worker.model_runner import ModelRunner

logger = logging.getLogger("llmmesh.engine")

DEFAULT_CPU_KV_CACHE_MEMORY = "2GiB"


class EngineCore:
    def __init__(self, args: EngineArgs):
        self.args = args
        start = time.perf_counter()
        self.device = torch.device(
            args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        )
        self.dtype = check_dtype(args.dtype, self.device.type)
        self.model_dir = prepare_model_dir(args.model, args.download_dir)
        self.model_config = load_config(self.model_dir)
        torch.manual_seed(args.seed)

        self.attn_backend = get_attn_backend(args.attention_backend, args.block_size)
        with torch.device(self.device):
            model = LlamaForCausalLM(self.model_config, self.attn_backend)
        model.load_weights(load_weights(self.model_dir))
        self.model = model.to(self.dtype).eval()

        cfg = self.model_config
        self.max_model_len = args.max_model_len or cfg.max_position_embeddings
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len={self.max_model_len} is larger than the model's "
                f"max_position_embeddings={cfg.max_position_embeddings}."
            )
        self.num_blocks = self._determine_num_blocks()
        block_size = args.block_size
        shape = self.attn_backend.get_kv_cache_shape(self.num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self.device), torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]
        capacity = self.num_blocks * block_size
        logger.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s)",
            self.num_blocks, block_size, capacity, self.num_blocks * self._block_bytes() / 2**30, self.dtype,
        )

        self.kv_cache_manager = KVCacheManager(
            self.num_blocks,
            block_size,
            enable_caching=args.enable_prefix_caching,
            hash_algo=args.prefix_caching_hash_algo,
            hash_seed=args.prefix_caching_hash_seed,
            watermark=args.watermark,
            enable_kv_cache_events=args.enable_kv_cache_events,
        )
        # A request can never grow past the whole pool, so that is its length cap too.
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=min(self.max_model_len, capacity),
            scheduling_policy=args.scheduling_policy,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
        )
        self.model_runner = ModelRunner(self.model, self.kv_caches, block_size, self.device)
        self._aborted: list[EngineCoreOutput] = []
        self.load_time_s = time.perf_counter() - start

    def _block_bytes(self) -> int:
        cfg = self.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * cfg.num_hidden_layers * self.args.block_size * cfg.num_key_value_heads * cfg.head_dim * element

    def _determine_num_blocks(self) -> int:
        if self.device.type == "cuda" and self.args.kv_cache_memory is None:
            budget = self._profile_gpu_kv_budget()
        else:
            budget = parse_memory_size(self.args.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY)
        num_blocks = budget // self._block_bytes()
        if num_blocks < 1:
            raise ValueError(
                f"The KV cache budget ({budget} bytes) holds no block of {self._block_bytes()} bytes; "
                "raise --kv-cache-memory or --gpu-memory-utilization."
            )
        return num_blocks

    @torch.inference_mode()
    def _profile_gpu_kv_budget(self) -> int:
        """vLLM's method: run the largest step once, keep what the model and its peak activations need."""
        from engine.attention.backend import AttentionMetadata

        cfg, bs = self.model_config, self.args.block_size
        n = min(self.args.max_num_batched_tokens, self.max_model_len)
        shape = self.attn_backend.get_kv_cache_shape(cdiv(n, bs), bs, cfg.num_key_value_heads, cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),) * 2 for _ in range(cfg.num_hidden_layers)]
        dev = self.device
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

    # ---- the API the offline LLM and the gRPC engine service drive -------------

    def add_request(self, request: Request) -> None:
        """Admit a request, or raise ValueError naming what is wrong; nothing else is affected."""
        self.validate_prompt(request.prompt_token_ids)
        self.validate_params(request.sampling_params)
        request.eos_token_ids = request.eos_token_ids or tuple(self.model_config.eos_token_ids)
        if request.request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use.")
        self.scheduler.add_request(request)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n, vocab = len(prompt_token_ids), self.model_config.vocab_size
        if n == 0:
            raise ValueError("The prompt is empty; it must contain at least one token.")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of vocabulary; prompt token ids must be in [0, {vocab}).")
        if n >= self.max_model_len:
            raise ValueError(
                f"The prompt (length {n}) is longer than the maximum model length of {self.max_model_len}; "
                f"it must be at most {self.max_model_len - 1} tokens so one can be generated."
            )
        capacity = self.num_blocks * self.args.block_size
        if n >= capacity:
            raise ValueError(
                f"The prompt (length {n}) can never fit the KV cache, which holds {capacity} tokens "
                f"({self.num_blocks} blocks of {self.args.block_size}); raise --kv-cache-memory."
            )

    def validate_params(self, params: SamplingParams) -> None:
        params.verify_for_model(self.model_config.vocab_size, self.args.max_logprobs)

    def abort_requests(self, request_ids) -> None:
        """End requests in any state; their blocks go back to the pool immediately."""
        for request in self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED):
            self._aborted.append(
                EngineCoreOutput(
                    request.request_id, [], request.get_finished_reason(), events=request.take_events()
                )
            )

    def step(self) -> list[EngineCoreOutput]:
        outputs, self._aborted = self._aborted, []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.model_runner.execute_model(scheduler_output)
        return outputs + self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def take_kv_events(self):
        return self.kv_cache_manager.take_events()
