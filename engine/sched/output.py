"""What the scheduler hands to the model runner, and what a step hands back to callers."""

from dataclasses import dataclass, field

import torch

from engine.request import EngineCoreEvent, FinishReason, Request, RequestFailure
from engine.sample.sampler import LogprobsTensors
from engine.spec_decode.metrics import SpecDecodingStats


@dataclass
class SchedulerOutput:
    # Running requests first, then the ones admitted this step, in batch order.
    scheduled_requests: list[Request]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # KV block ids of each scheduled request: its block table row in each KV cache group (engine.kv.kv_cache_spec).
    block_ids: dict[str, list[list[int]]]
    preempted_req_ids: set[str] = field(default_factory=set)
    # Requests that finished since the previous step (so per-request state can be dropped).
    finished_req_ids: set[str] = field(default_factory=set)
    # The KV connector's loads and stores for this step (None without a connector).
    kv_connector_metadata: object = None
    # Structured requests that sample in this step -> their row of grammar_bitmask ([rows, ceil(vocab / 32)] int32 on
    # the host, xgrammar's packed bits: set = the token is allowed next). None when no such request is scheduled.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: torch.Tensor | None = None
    # Speculative decoding: request_id -> the drafts scheduled for verification after its last token (the
    # request's num_scheduled_tokens counts them). Requests without drafts are absent.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # The step span's traceparent/tracestate (--collect-detailed-traces): the step's sampler calls join its trace.
    trace_headers: tuple[tuple[str, str], ...] = ()
    # Images: request_id -> the images (engine.multimodal.inputs.MultiModalFeatureSpec) whose embeddings the runner
    # computes in this step, before the forward pass; and the content hashes of embeddings it may drop, before those.
    scheduled_encoder_inputs: dict[str, list] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, per scheduled request (in scheduled_requests order)."""

    # The tokens each request produced: one sampled token, or with drafts the accepted drafts and the target's
    # own token; [] for a row still in the middle of its prompt.
    sampled_token_ids: list[list[int]]
    # Speculative decoding: request_id -> the drafts proposed to follow its new tokens.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # request_id -> one row per new token: the token's logprob and rank, then the request's top k.
    logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    # request_id -> one row per prompt token after the first; sent once the whole prompt has run.
    prompt_logprobs: dict[str, LogprobsTensors] = field(default_factory=dict)
    # Transfers the KV connector finished (None without a connector).
    kv_connector_output: object = None
    # Requests that failed on their own in this step (their row has no token); the core ends them alone.
    failed: dict[str, RequestFailure] = field(default_factory=dict)
    # Pooling requests whose prompt completed in this step -> their pooled vector (float32, on the host).
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)
    sample_s: float = 0.0  # the step's sampling, in process or on the sampler service (host time)
    # request_id -> (start, end, embedding tokens) of each image the encoder computed for it in this step
    # (time.monotonic()).
    encoder_runs: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    events: list[EngineCoreEvent] = field(default_factory=list)
    num_cached_tokens: int = 0
    new_logprobs: LogprobsTensors | None = None
    new_prompt_logprobs: LogprobsTensors | None = None
    failure: RequestFailure | None = None  # with FinishReason.ERROR
    pooling_output: torch.Tensor | None = None  # a finished pooling request's vector

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """The engine's state after a step, for load reports and metrics (vLLM's SchedulerStats)."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float  # fraction of KV blocks held by requests, 0..1
    # Cumulative, counted in tokens, as vLLM's PrefixCacheStats.
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int  # cumulative
    num_blocks: int
    num_loading_reqs: int = 0  # waiting for a KV connector's load
    # Cumulative KV connector counters (tokens loaded, load faults, blocks stored...); None without one.
    kv_connector_stats: dict | None = None
    # LoRA adapter name -> its running / waiting requests (vLLM's lora_requests_info); empty without adapters.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    # Cumulative drafts proposed and accepted; None without speculative decoding.
    spec_decoding_stats: SpecDecodingStats | None = None
    # A vision-language model's encoder cache: the share of it requests need now, and its cumulative images
    # looked up, found held and computed (engine.multimodal.encoder_cache.EncoderCacheStats); None for text-only.
    encoder_cache_usage: float | None = None
    encoder_cache_stats: object = None
