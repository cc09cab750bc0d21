"""What the offline API returns, shaped like vllm.RequestOutput."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.request import RequestFailure


@dataclass
class Logprob:
    """One candidate token's log probability, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token_id: Logprob}, the sampled token first, then the top k.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first (nothing predicts it), then as above.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps in time.monotonic() seconds, like vLLM's RequestStateStats."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    preemption_times: list[float] = field(default_factory=list)  # when each preemption happened
    # KV connector transfers: (when, "kv_load_started" | "kv_loaded" | "kv_store_started", tokens)
    kv_transfers: list[tuple[float, str, int]] = field(default_factory=list)
    # Images the vision encoder computed for the request: (start, end, embedding tokens).
    encoder_runs: list[tuple[float, float | None, int]] = field(default_factory=list)

    @property
    def time_in_queue(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """From first scheduled to first token (vLLM's request_prefill_time)."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """From first token to last token (vLLM's request_decode_time)."""
        if self.first_token_time is None:
            return None
        return (self.last_token_time or self.first_token_time) - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    # Set when the request failed on its own (its completions end with finish_reason "error"); its batch mates
    # were not affected.
    error: "RequestFailure | None" = None


@dataclass
class PoolingOutput:
    data: "torch.Tensor"  # the pooled vector, float32 on the host


@dataclass
class PoolingRequestOutput:
    """A pooling request's one output, once its prompt has run (vllm.PoolingRequestOutput)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: "RequestFailure | None" = None  # never set: a failed request's output is a RequestOutput


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns for each prompt (vllm.EmbeddingRequestOutput)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0

    @classmethod
    def from_base(cls, output: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        embedding = EmbeddingOutput(output.outputs.data.tolist())
        return cls(output.request_id, embedding, output.prompt_token_ids, output.finished, output.num_cached_tokens)
