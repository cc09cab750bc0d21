"""EngineInfo: what the services read of the engine, in one read-only snapshot.

The engine thread builds it and, when something in it changes (an adapter loaded or removed, the KV connector's
figures after a step), builds a new one and swaps it in with one assignment: another thread reads a consistent
whole without a lock, and never the core or its workers.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from engine.kv.connector.base import KVConnectorStats
from engine.kv.layout import KVLayout
from engine.lora.request import LoRARequest


@dataclass(frozen=True)
class EngineInfo:
    # The model and its limits.
    model: str  # as given (--model): the served model's name
    model_dir: Path  # its files, the tokenizer's among them
    architecture: str
    runner_type: str  # "generate" or "pooling" (--runner): whether requests generate tokens or embed their prompt
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str  # the compute dtype by its torch name, e.g. "bfloat16"
    device: str
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int  # requests in flight past max_num_seqs at most (AsyncLLM refuses one more)
    max_logprobs: int
    # The KV cache.
    block_size: int
    num_blocks: int
    attention_backend: str
    enable_prefix_caching: bool
    prefix_caching_hash_algo: str
    prefix_caching_hash_seed: str | None
    enable_kv_cache_events: bool
    # LoRA adapters: the loaded ones by name, and by id the digest of each one's weights (its blocks' extra key).
    enable_lora: bool
    max_loras: int
    max_lora_rank: int
    lora_adapters: Mapping[str, LoRARequest]
    lora_digests: Mapping[int, bytes]
    # The KV connector, None without one: its role, what a block of each KV cache group is to it, its figures.
    kv_role: str | None
    kv_layouts: tuple[KVLayout, ...] | None
    kv_connector_stats: KVConnectorStats | None

    @property
    def num_kv_cache_tokens(self) -> int:
        """Tokens the KV cache holds when full."""
        return self.num_blocks * self.block_size
