"""The engine's configuration in vLLM's shape: composed configs (model, cache, scheduler, parallel, sampler, LoRA,
speculative decoding, KV transfer), each a dataclass that declares its settings and checks itself, and EngineArgs,
the flat front with vLLM's names that the offline LLM's keywords and the engine's flags are, which builds them."""

import argparse
import dataclasses
import json
from dataclasses import dataclass, field, fields

from engine.config.cache import CacheConfig
from engine.config.kv_events import KVEventsConfig
from engine.config.lora import LoRAConfig
from engine.config.model import DEFAULT_MODEL, MAX_CUDAGRAPH_CAPTURE_SIZE, ModelConfig
from engine.config.parallel import ParallelConfig
from engine.config.sampler import SamplerConfig
from engine.config.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from engine.config.utils import (
    add_argument,
    add_cli_args,
    config_from,
    description,
    parse_int_list,
    parse_memory_size,
    setting,
)
from engine.kv.connector.base import KVTransferConfig
from engine.spec_decode.config import SpeculativeConfig

__all__ = [
    "DEFAULT_MODEL",
    "CacheConfig",
    "EngineArgs",
    "EngineConfig",
    "KVEventsConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "SamplerConfig",
    "SchedulerConfig",
    "parse_int_list",
    "parse_memory_size",
]


@dataclass
class EngineConfig:
    """The engine's composed configs (vLLM's VllmConfig); speculative decoding and the KV connector are given as
    JSON on the command line (or a dict, offline)."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    sampler_config: SamplerConfig = field(default_factory=SamplerConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    speculative_config: SpeculativeConfig | None = setting(
        None,
        help='speculative decoding as JSON: {"method":"ngram","num_speculative_tokens":K,"prompt_lookup_max":5,'
        '"prompt_lookup_min":2} (drafts copied from the request\'s own tokens) or {"method":"draft_model",'
        '"model":PATH,"num_speculative_tokens":K} (a smaller model with the same vocabulary); K in [1, 16]; '
        "unset: off",
    )
    # A KV connector the factory knows (KVStoreConnector, SharedStorageConnector with {"shared_storage_path": DIR})
    # or a class of the module kv_connector_module_path names.
    kv_transfer_config: KVTransferConfig | None = setting(
        None,
        help="vLLM's KV connector as JSON, e.g. "
        '{"kv_connector":"KVStoreConnector","kv_role":"kv_both","kv_connector_extra_config":'
        '{"kvstore_address":"127.0.0.1:50054"}}; unset: none (llmmesh serve sets it)',
    )
    kv_events_config: KVEventsConfig | None = setting(
        None,
        help="vLLM's KV-cache events on a ZMQ PUB socket (msgpack KVEventBatch: BlockStored, BlockRemoved, "
        'AllBlocksCleared), as JSON, e.g. {"enable_kv_cache_events":true,"publisher":"zmq",'
        '"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","topic":"kv@POD@MODEL"}; also buffer_steps, '
        "hwm, max_queue_size; unset: off",
    )

    def __post_init__(self):
        spec = self.speculative_config
        if self.parallel_config.tensor_parallel_size > 1 and spec is not None and spec.method != "ngram":
            # N-gram drafts reach every rank in the SchedulerOutput; a draft model is not sharded.
            raise ValueError(
                "speculative_config.method draft_model is not supported with tensor_parallel_size > 1 yet; "
                "method ngram is."
            )
        if self.parallel_config.pipeline_parallel_size > 1:
            self._check_pipeline_parallel()
        if self.kv_transfer_config is not None and not self.cache_config.enable_prefix_caching:
            raise ValueError("kv_transfer_config needs prefix caching: its blocks are named by their prefix hashes.")
        events = self.kv_events_config
        if events is not None and events.enable_kv_cache_events:
            if not self.cache_config.enable_prefix_caching:
                raise ValueError(
                    "kv_events_config.enable_kv_cache_events needs prefix caching: the events name cached blocks."
                )
            # The block pool records events for the ZMQ publisher and the engine protocol's streams alike.
            self.cache_config.enable_kv_cache_events = True

    def _check_pipeline_parallel(self) -> None:
        """What does not combine with pipeline stages yet is refused, naming the flags."""
        size = self.parallel_config.pipeline_parallel_size
        refused = {
            "--speculative-config": self.speculative_config is not None,  # drafts need the last stage's tokens
            "--enable-lora": self.lora_config.enable_lora,  # adapters are put in slots on one rank's runner
            "--kv-transfer-config": self.kv_transfer_config is not None,  # a block's layers live on several ranks
            "--sampler-address": bool(self.sampler_config.sampler_address),  # the last stage samples in process
            "--runner pooling": self.model_config.runner == "pooling",  # its vectors do not travel back to rank 0
        }
        for flag, used in refused.items():
            if used:
                raise ValueError(
                    f"{flag} is not implemented with --pipeline-parallel-size {size}; use one or the other"
                )

    def get_cudagraph_capture_sizes(self) -> list[int]:
        """The decode batch sizes that get a CUDA graph, ascending; none above max_num_seqs or the token budget."""
        sched = self.scheduler_config
        limit = min(sched.max_num_seqs, sched.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS["cuda"])
        sizes = self.model_config.cudagraph_capture_sizes
        if sizes is None:
            sizes = [1, 2, 4, *range(8, MAX_CUDAGRAPH_CAPTURE_SIZE + 1, 8)]
        return sorted({s for s in sizes if s <= limit})


# The composed configs whose fields EngineArgs has, flat, in the order of their flags' groups.
_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig, ParallelConfig, SamplerConfig, LoRAConfig)

# EngineArgs' fields but the two given as JSON: each config's, with its default, choices and help.
_ConfigFields = dataclasses.make_dataclass(
    "_ConfigFields",
    [(f.name, f.type, field(default=f.default, metadata=f.metadata)) for c in _CONFIGS for f in dataclasses.fields(c)],
)


@dataclass
class EngineArgs(_ConfigFields):
    """Every engine setting in one flat dataclass with vLLM's names: the offline LLM's keywords and the engine's
    flags. Each is declared (default, choices, help) on the config it belongs to; create_engine_config() builds
    those, and checks them."""

    speculative_config: str | dict | None = None  # JSON (or a dict, offline) of EngineConfig.speculative_config
    kv_transfer_config: str | None = None  # JSON of EngineConfig.kv_transfer_config
    kv_events_config: str | dict | None = None  # JSON (or a dict, offline) of EngineConfig.kv_events_config

    def __post_init__(self):
        config = self.create_engine_config()
        if config.kv_transfer_config is not None:
            # Written back resolved (a registered connector's module path in it), for processes that registered none.
            self.kv_transfer_config = json.dumps(dataclasses.asdict(config.kv_transfer_config))

    def create_engine_config(self) -> EngineConfig:
        """The composed configs these settings make; a ValueError names a setting that is out of range."""
        return EngineConfig(
            model_config=config_from(ModelConfig, self),
            cache_config=config_from(CacheConfig, self),
            scheduler_config=config_from(SchedulerConfig, self),
            parallel_config=config_from(ParallelConfig, self),
            sampler_config=config_from(SamplerConfig, self),
            lora_config=config_from(LoRAConfig, self),
            speculative_config=self.get_speculative_config(),
            kv_transfer_config=self.get_kv_transfer_config(),
            kv_events_config=self.get_kv_events_config(),
        )

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "EngineArgs":
        """The flat settings of composed configs: what crosses a process boundary as JSON."""
        values = {f.name: getattr(c, f.name) for c in vars(config).values() if type(c) in _CONFIGS for f in fields(c)}
        spec, kv, events = config.speculative_config, config.kv_transfer_config, config.kv_events_config
        return cls(
            **values,
            speculative_config=None if spec is None else spec.to_dict(),
            kv_transfer_config=None if kv is None else json.dumps(dataclasses.asdict(kv)),
            kv_events_config=None if events is None else events.to_dict(),
        )

    def get_lora_modules(self) -> dict[str, str]:
        """LoRAConfig.get_lora_modules() of these settings."""
        return config_from(LoRAConfig, self).get_lora_modules()

    def get_cudagraph_capture_sizes(self) -> list[int]:
        """EngineConfig.get_cudagraph_capture_sizes() of these settings."""
        return self.create_engine_config().get_cudagraph_capture_sizes()

    def get_kv_transfer_config(self) -> KVTransferConfig | None:
        return None if self.kv_transfer_config is None else KVTransferConfig.from_json(self.kv_transfer_config)

    def get_kv_events_config(self) -> KVEventsConfig | None:
        return None if self.kv_events_config is None else KVEventsConfig.from_json(self.kv_events_config)

    def get_speculative_config(self) -> SpeculativeConfig | None:
        return None if self.speculative_config is None else SpeculativeConfig.from_json(self.speculative_config)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """One --flag-name per field (bools get --no- forms), in a group per config that declares them."""
        for config in _CONFIGS:
            add_cli_args(parser, config)
        group = parser.add_argument_group(EngineConfig.__name__, description(EngineConfig))
        declared = {f.name: f for f in dataclasses.fields(EngineConfig)}
        for f in dataclasses.fields(cls):
            if f.name in declared:
                add_argument(group, declared[f.name], f.type)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        return config_from(cls, args)
