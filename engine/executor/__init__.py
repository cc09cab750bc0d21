"""Executors (vLLM's seam between the engine core and its workers): the core schedules once and hands each step
to its executor, which runs it on one worker in this process, or on one worker per rank (tensor- and
pipeline-parallel)."""

from pathlib import Path

from engine.config import EngineConfig
from engine.models.config import ModelArchConfig
from engine.models.fused_moe import check_expert_parallel


def make_executor(config: EngineConfig, model_config: ModelArchConfig, model_dir: Path, max_model_len: int):
    """The executor for config.parallel_config's ranks, with the model (its stage) loaded on every rank."""
    if config.parallel_config.enable_expert_parallel:  # before any rank starts
        check_expert_parallel(model_config, config.parallel_config.tensor_parallel_size)
    if config.parallel_config.world_size == 1:
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model_config, model_dir, max_model_len)
    from engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_config, model_dir, max_model_len)
