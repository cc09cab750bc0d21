"""PoolingParams: what one pooling request asks for (vllm.PoolingParams, its embedding task's fields)."""

from dataclasses import dataclass


@dataclass
class PoolingParams:
    """normalize: L2-normalise the pooled vector; None: as the model's pooler config says.

    skip_reading_prefix_cache is set at admission, from the engine's pooler: a pooling that reads every prompt
    position (MEAN, CLS) must compute them all, so the request takes no prefix-cache hits (its blocks are still
    cached for others, their KV being the same)."""

    normalize: bool | None = None
    skip_reading_prefix_cache: bool = False

    def __post_init__(self):
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true, false or unset, got {self.normalize!r}.")
