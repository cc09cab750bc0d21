"""The executor of one worker, in the engine core's process."""

from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.distributed.parallel_state import get_pp_rank, get_pp_size
from engine.kv.layout import KVLayout
from engine.models.config import ModelArchConfig
from engine.sched.output import ModelRunnerOutput, SchedulerOutput
from engine.worker.worker import Worker


class ExecutorDeadError(RuntimeError):
    """A rank is gone (or its collectives failed): the ranks are out of step, so the engine cannot go on."""


class UniProcExecutor:
    def __init__(self, config: EngineConfig, model_config: ModelArchConfig, model_dir: Path, max_model_len: int):
        self.driver_worker = self._make_driver_worker(config, model_config, model_dir, max_model_len)
        self.driver_worker.load_model()
        # Called (from another thread) with the reason once a rank is gone, so an idle engine learns of it too.
        self.on_failure: Callable[[str], None] | None = None

    def _make_driver_worker(self, config, model_config, model_dir, max_model_len) -> Worker:
        return Worker(config, model_config, model_dir, max_model_len)

    # ---- what the engine core knows of its workers: rank 0's, as every rank runs the same model and settings ----

    @property
    def device(self) -> torch.device:
        return self.driver_worker.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype."""
        return self.driver_worker.dtype

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.driver_worker.kv_cache_dtype

    @property
    def attention_backend(self) -> str:
        return self.driver_worker.attn_backend.name

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots a request needs past its tokens for speculative decoding's drafts; 0 without a drafter."""
        drafter = self.driver_worker.drafter
        return drafter.num_lookahead_tokens if drafter else 0

    def get_kv_layouts(self) -> list[KVLayout]:
        """What one KV block is outside the paged cache, for a KV connector."""
        return self.driver_worker.kv_layouts

    def get_cache_block_size_bytes(self) -> int:
        return self.driver_worker.get_cache_block_size_bytes()

    # ---- running the workers ----------------------------------------------------------------------------

    def determine_num_available_blocks(self) -> int:
        return self.driver_worker.determine_num_available_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.driver_worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput, while_waiting=None) -> ModelRunnerOutput:
        """while_waiting: called while the step's tokens are being sampled (async scheduling)."""
        worker = self.driver_worker
        # The model runner asks the process which stage it is at every step: another engine that started pipeline
        # stages in this process would make this one send its activations away and sample nothing, step after step.
        if (get_pp_rank(), get_pp_size()) != (worker.pp_rank, worker.pp_size):
            raise RuntimeError(
                f"this engine is pipeline stage {worker.pp_rank} of {worker.pp_size}, but its process is now stage "
                f"{get_pp_rank()} of {get_pp_size()}: an engine with --pipeline-parallel-size above 1 must be the "
                "only engine in its process"
            )
        return worker.execute_model(scheduler_output, while_waiting)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None) -> list:
        """Worker.<method>(*args, **kwargs) on every rank (here the one); the results in rank order."""
        return [getattr(self.driver_worker, method)(*args, **(kwargs or {}))]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
