"""ParallelConfig: how the model is split across processes."""

from dataclasses import dataclass

from engine.config.utils import setting

# Most tensor-parallel ranks: each is a process, so a typo must not start thousands.
MAX_TENSOR_PARALLEL_SIZE = 64
# Most pipeline stages: as many processes again for each tensor-parallel rank.
MAX_PIPELINE_PARALLEL_SIZE = 64


@dataclass
class ParallelConfig:
    """Tensor parallelism: one worker process per rank (engine.executor); with one rank the worker runs in
    process. With expert parallelism the same ranks split a mixture of experts by expert instead. Pipeline
    parallelism splits the layers into stages of --tensor-parallel-size ranks each."""

    tensor_parallel_size: int = setting(
        1,
        help="ranks the model is split across (Megatron-style: heads, MLP and vocabulary), one process each, "
        "meeting at $MASTER_ADDR:$MASTER_PORT (default: this host and a free port); the heads, KV heads and MLP "
        "width must divide by it",
    )

    enable_expert_parallel: bool = setting(
        False,
        help="split each mixture-of-experts layer across the --tensor-parallel-size ranks by expert (each rank "
        "holds num_experts / N whole experts) instead of slicing every expert's width; attention and the dense "
        "layers stay tensor-parallel. Mixture-of-experts models only; the expert count must divide by the ranks",
    )

    pipeline_parallel_size: int = setting(
        1,
        help="stages the decoder layers are split across, each of --tensor-parallel-size ranks (one process a "
        "rank, TP x PP in all, meeting as the tensor-parallel ranks do); the engine keeps this many batches in "
        "flight so that every stage has work. The model needs at least this many layers",
    )

    @property
    def world_size(self) -> int:
        """Every rank: a process each."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self):
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(
                f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {self.tensor_parallel_size}."
            )
        if not 1 <= self.pipeline_parallel_size <= MAX_PIPELINE_PARALLEL_SIZE:
            raise ValueError(
                f"pipeline_parallel_size must be in [1, {MAX_PIPELINE_PARALLEL_SIZE}], got "
                f"{self.pipeline_parallel_size}."
            )
