"""ParallelConfig: how the model is split across processes."""

from dataclasses import dataclass

from engine.config.utils import setting

# Most tensor-parallel ranks: each is a process, so a typo must not start thousands.
MAX_TENSOR_PARALLEL_SIZE = 64


@dataclass
class ParallelConfig:
    """Tensor parallelism: one worker process per rank (engine.executor); with one rank the worker runs in
    process."""

    tensor_parallel_size: int = setting(
        1,
        help="ranks the model is split across (Megatron-style: heads, MLP and vocabulary), one process each, "
        "meeting at $MASTER_ADDR:$MASTER_PORT (default: this host and a free port); the heads, KV heads and MLP "
        "width must divide by it",
    )

    def __post_init__(self):
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(
                f"tensor_parallel_size must be in [1, {MAX_TENSOR_PARALLEL_SIZE}], got {self.tensor_parallel_size}."
            )
