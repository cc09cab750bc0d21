"""CacheConfig: the KV cache's blocks, dtype, memory and prefix caching."""

from dataclasses import dataclass

from engine.attention import KV_CACHE_DTYPES
from engine.config.utils import check_choices, parse_memory_size, setting


@dataclass
class CacheConfig:
    """The KV cache: its block size, dtype and memory, and the prefix cache over it."""

    block_size: int = setting(16, help="tokens per KV-cache block (a power of two)")
    # What the KV cache stores (engine.attention.backend.resolve_kv_cache_dtype).
    kv_cache_dtype: str = setting(
        "auto",
        choices=KV_CACHE_DTYPES,
        help="the KV cache's dtype: auto (the model's), bfloat16, float16, or fp8 (= fp8_e4m3) and fp8_e5m2, one "
        "byte a value with a scale of 1.0, saturating at the format's largest value",
    )
    # CPU: bytes for the KV cache (vLLM's VLLM_CPU_KVCACHE_SPACE). GPU: ignored unless set.
    kv_cache_memory: str | None = setting(
        None,
        help="the KV cache's budget in bytes, or with a GiB/MiB/KiB/GB/MB/KB suffix; unset: 2GiB on CPU, on a GPU "
        "the memory is profiled and --gpu-memory-utilization applies",
    )
    gpu_memory_utilization: float = setting(
        0.9, help="share of the GPU's memory for the weights, activations and KV cache"
    )
    enable_prefix_caching: bool = setting(
        True, help="reuse the cached full blocks of a prompt's prefix across requests"
    )
    prefix_caching_hash_algo: str = setting("sha256", help="hash naming a prefix's blocks: sha256 or blake2b")
    prefix_caching_hash_seed: str | None = setting(
        None, help="a seed mixed into every block hash, so one deployment's hashes are its own"
    )
    enable_kv_cache_events: bool = setting(
        False,
        help="publish vLLM's KV-cache events (blocks stored, removed, cleared) on the engine protocol, for a "
        "cache-aware router",
    )

    def __post_init__(self):
        check_choices(self)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.kv_cache_memory is not None:
            parse_memory_size(self.kv_cache_memory)
