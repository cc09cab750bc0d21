"""SchedulerConfig: what one engine step may hold and in which order requests are served."""

from dataclasses import dataclass

from engine.config.utils import check_choices, setting

# The step's token budget when unset, by device. A CPU's step time grows in proportion to its prompt tokens from a
# few hundred on (its products are compute-bound), so a burst of prompts taken a few at a time gets its first tokens
# one after another instead of all at the end of one long step, at the same throughput. A GPU's step time stays
# flat far longer, and larger steps use it better.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 512, "cuda": 2048}
# An image is encoded whole in one step, so the encoder's budget does not follow the step budget's device default.
DEFAULT_ENCODER_BUDGET = 2048


@dataclass
class SchedulerConfig:
    """The scheduler: each step's token and request budget, the queue's policy, chunked prefill and async
    scheduling."""

    max_num_batched_tokens: int | None = setting(
        None, help="tokens scheduled in one step at most; unset: 512 on CPU, 2048 on a GPU"
    )
    max_num_seqs: int = setting(256, help="requests running at once at most")
    scheduling_policy: str = setting(
        "fcfs",
        choices=("fcfs", "priority"),
        help="fcfs (first come, first served) or priority (lowest priority value first)",
    )
    max_waiting_requests: int = setting(
        1024,
        help="requests that may wait beyond the --max-num-seqs that run: one more is refused (RESOURCE_EXHAUSTED "
        "through the services) rather than queued without bound",
    )
    long_prefill_token_threshold: int = setting(0, help="cap on one request's prefill chunk per step; 0: no cap")
    watermark: float = setting(
        0.0, help="share of the KV-cache blocks held back from new requests, so running ones can grow"
    )
    # vLLM's --async-scheduling: the next step is scheduled while this one's tokens are being sampled.
    async_scheduling: bool = setting(
        True,
        help="allocate the next step's KV blocks, and build a step of decodes' inputs, while this step's tokens "
        "are being sampled (on the sampler service, or on the device); outputs are the same either way",
    )
    # vLLM's encoder budgets, for vision-language models, in embedding tokens (an image's placeholder length).
    max_num_encoder_input_tokens: int | None = setting(
        None,
        help="image embedding tokens the vision encoder computes in one step at most; unset: max_num_batched_tokens "
        "when that is set, else 2048",
    )
    encoder_cache_size: int | None = setting(
        None,
        help="image embedding tokens the encoder cache holds (shared by requests with the same image); unset: "
        "max_num_batched_tokens when that is set, else 2048",
    )
    encoder_cache_keep_unused: bool = setting(
        True,
        help="keep an image's embeddings in the encoder cache after the last request that needed them, for a later "
        "request with the same image, until their room is needed; off: drop them at once, so only requests that need "
        "the same image at the same time share its embeddings",
    )

    def __post_init__(self):
        for name in ("max_num_batched_tokens", "max_num_encoder_input_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}.")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}.")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}.")
        check_choices(self)

    def resolve(self, device: str) -> None:
        """The defaults that depend on the device (cpu or cuda); the engine calls it once it knows the device."""
        encoder_default = self.max_num_batched_tokens or DEFAULT_ENCODER_BUDGET
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS[device]
        if self.max_num_encoder_input_tokens is None:
            self.max_num_encoder_input_tokens = encoder_default
        if self.encoder_cache_size is None:
            self.encoder_cache_size = encoder_default
        if self.encoder_cache_size < self.max_num_encoder_input_tokens:
            raise ValueError(
                f"encoder_cache_size ({self.encoder_cache_size}) must be at least max_num_encoder_input_tokens "
                f"({self.max_num_encoder_input_tokens}): a step's images must fit the cache."
            )
