"""Pooling models (vLLM's --runner pooling): a request runs its prompt once, and its hidden states are pooled into
one vector instead of sampling a token (the Pooler, engine.pooling.pooler, is the runner's alone)."""

from engine.pooling.config import POOLING_TYPES, RUNNER_TYPES, PoolerConfig, get_pooler_config, resolve_runner
from engine.pooling.params import PoolingParams

__all__ = ["POOLING_TYPES", "RUNNER_TYPES", "PoolerConfig", "PoolingParams", "get_pooler_config", "resolve_runner"]
