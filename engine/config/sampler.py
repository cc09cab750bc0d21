"""SamplerConfig: where each step's tokens are sampled."""

from dataclasses import dataclass

from engine.config.utils import setting


@dataclass
class SamplerConfig:
    """Where each step is sampled: in process, or on a sampler service (llmmesh sampler) that the engine reaches
    through the client the mesh registers."""

    sampler_address: str | None = setting(
        None,
        help="HOST:PORT of a sampler service (llmmesh sampler) that samples each step; unset: sample in process "
        "(llmmesh serve sets it)",
    )
    sampler_timeout: float = setting(
        10.0,
        help="seconds a step waits for the sampler service; past it, or when the service is down, the step's "
        "requests end with UNAVAILABLE and the engine goes on",
    )
    sampler_fallback: bool = setting(
        False, help="sample in process a step the sampler service cannot serve, instead of failing its requests"
    )

    def __post_init__(self):
        if self.sampler_timeout <= 0:
            raise ValueError(f"sampler_timeout must be positive, got {self.sampler_timeout}.")
