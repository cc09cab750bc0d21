"""Requests, their states and sampling parameters (vLLM's names)."""

import copy
import enum
import json
import math
import time
from dataclasses import dataclass, field

from engine.lora.request import LoRARequest
from engine.pooling.params import PoolingParams
from engine.structured_output.request import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    # Its grammar is compiling: it waits in line while the others run.
    WAITING_FOR_FSM = 1
    # Admitted with blocks reserved, while a KV connector loads its prefix into them.
    WAITING_FOR_REMOTE_KVS = 2
    RUNNING = 3
    PREEMPTED = 4
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = 5
    FINISHED_LENGTH_CAPPED = 6
    FINISHED_ABORTED = 7
    FINISHED_IGNORED = 8
    # Per-request work in a step raised for this request alone (its EngineCoreOutput.failure says what).
    FINISHED_ERROR = 9

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> "FinishReason | None":
        return _FINISHED_REASONS.get(status)


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISHED_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class RequestFailure:
    """Why one request ended with FinishReason.ERROR while its batch mates went on. invalid_input: its own input
    was at fault (a ValueError from a check of what it asked for); otherwise the engine failed it."""

    message: str
    invalid_input: bool = False

    @classmethod
    def from_exception(cls, request_id: str, where: str, error: Exception) -> "RequestFailure":
        return cls(
            f"request {request_id}: {where} failed: {type(error).__name__}: {error}",
            invalid_input=isinstance(error, ValueError),
        )


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3
    # A KV connector: a load of num_tokens began, ended (num_tokens arrived), or a store of num_tokens began.
    KV_LOAD_STARTED = 4
    KV_LOADED = 5
    KV_STORE_STARTED = 6
    # The vision encoder began, and ended, computing one image's embeddings for the request (num_tokens of them).
    ENCODE_STARTED = 7
    ENCODED = 8


@dataclass
class EngineCoreEvent:
    type: EngineCoreEventType
    timestamp: float  # time.monotonic()
    num_tokens: int = 0  # for the KV connector's events


# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
SAMPLING_EPS = 1e-5
# logit_bias values are clamped to this range, as vLLM does.
MAX_LOGIT_BIAS = 100.0


# StructuredOutputsParams' constraints: exactly one is set.
STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """vllm.sampling_params.StructuredOutputsParams: the output must match exactly one constraint.

    json: a JSON schema (a dict, or its JSON text); regex; choice: one of these strings; grammar: EBNF (xgrammar's
    dialect, as GBNF); json_object: any JSON; structural_tag: xgrammar's structural tag as JSON text.
    disable_any_whitespace: JSON without whitespace between its tokens (json, json_object).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self):
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        set_kinds = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        _check(
            len(set_kinds) == 1,
            "structured_outputs",
            f"must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
            set_kinds,
        )
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            _check(value is None or isinstance(value, str), f"structured_outputs.{name}", "must be a string", value)
        if self.choice is not None:
            self.choice = list(self.choice)
            _check(
                len(self.choice) > 0 and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice",
                "must be a non-empty list of non-empty strings",
                self.choice[:3],
            )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """vllm.SamplingParams for generation: the same fields, defaults and meaning."""

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # -1: the whole vocabulary
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens; -1: max_model_len
    structured_outputs: StructuredOutputsParams | None = None
    # Token-id sequences of bad_words, filled in from the tokenizer (update_from_tokenizer).
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError) as e:
                raise ValueError(f"logit_bias must map token ids (integers) to numbers: {e}") from None
            _check(
                all(math.isfinite(b) for b in bias.values()),
                "logit_bias",
                "values must be finite numbers",
                [b for b in bias.values() if not math.isfinite(b)][:1],
            )
            self.logit_bias = {t: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b)) for t, b in bias.items()}
        self.verify()
        if self.greedy:
            # Greedy sampling ignores the truncation knobs, as in vLLM.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def verify(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check(math.isfinite(getattr(self, name)), name, "must be a finite number", getattr(self, name))
        _check(self.n >= 1, "n", "must be at least 1", self.n)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]", self.frequency_penalty)
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be greater than 0", self.repetition_penalty)
        _check(self.temperature >= 0.0, "temperature", "must be non-negative", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be -1 or 0 (disable), or at least 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "must be at least 1", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be greater than or equal to 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                f"must be less than or equal to max_tokens={self.max_tokens}",
                self.min_tokens,
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or value >= -1, name, "must be non-negative, or -1 for the whole vocabulary", value)
        _check(
            self.truncate_prompt_tokens is None
            or self.truncate_prompt_tokens >= 1
            or self.truncate_prompt_tokens == -1,
            "truncate_prompt_tokens",
            "must be at least 1, or -1 for the model's maximum length",
            self.truncate_prompt_tokens,
        )
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings", self.stop)
        _check(
            not self.stop or self.detokenize,
            "stop",
            "needs detokenize=True (stop strings are found in text)",
            self.stop,
        )
        _check(
            all(isinstance(w, str) and w for w in self.bad_words),
            "bad_words",
            "must be non-empty strings",
            self.bad_words,
        )
        _check(
            self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
            "allowed_token_ids",
            "must not be empty (None allows every token)",
            self.allowed_token_ids,
        )
        _check(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "must be a StructuredOutputsParams",
            type(self.structured_outputs).__name__,
        )

    def verify_for_model(self, vocab_size: int, max_logprobs: int) -> None:
        """The checks that need the model: token ids inside the vocabulary, logprobs under --max-logprobs."""
        ids = {
            "logit_bias": list(self.logit_bias or ()),
            "allowed_token_ids": list(self.allowed_token_ids or ()),
            "stop_token_ids": self.stop_token_ids,
        }
        for name, token_ids in ids.items():
            bad = [t for t in token_ids if not 0 <= t < vocab_size]
            _check(not bad, name, f"token ids must be in [0, {vocab_size})", bad[:3])
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            num = vocab_size if value == -1 else value
            _check(
                max_logprobs == -1 or num <= max_logprobs,
                name,
                f"must be at most --max-logprobs={max_logprobs}",
                value,
            )

    def update_from_tokenizer(self, encode) -> None:
        """Token ids of each bad word, both at the start of text and after a space (vLLM's rule).

        `encode(text) -> list[int]` without special tokens.
        """
        self.bad_words_token_ids = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            self.bad_words_token_ids.append(plain)
            spaced = encode(" " + word.lstrip())
            # Keep the spaced form only when it is a different word of the same length in tokens.
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                self.bad_words_token_ids.append(spaced)

    def clone(self, **changes) -> "SamplingParams":
        """A copy with some fields changed, not verified again (the n children of a verified request)."""
        params = copy.copy(self)
        for name, value in changes.items():
            setattr(params, name, value)
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _check(ok: bool, name: str, rule: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}.")


class Request:
    """One sequence inside the engine: its tokens, progress and status."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: tuple[int, ...] = (),
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora_request: LoRARequest | None = None,
        trace_headers: tuple[tuple[str, str], ...] = (),
        kv_transfer_params: dict | None = None,
        pooling_params: PoolingParams | None = None,
        mm_features: list | None = None,
        output_token_ids: list[int] = (),
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        # The adapter it runs with; None: the base model.
        self.lora_request = lora_request
        # W3C traceparent/tracestate of the request's span (vLLM's trace_headers), as gRPC metadata: the calls the
        # engine makes for this request (the KV store's) join its trace. Empty when it is not traced.
        self.trace_headers = trace_headers
        # vLLM's kv_transfer_params with disaggregated prefill: do_remote_prefill makes the KV connector load what the
        # store holds of the prompt, whatever its own load-or-recompute estimate says.
        self.kv_transfer_params: dict = kv_transfer_params or {}
        # A pooling request (--runner pooling): its prompt runs once and it ends with the pooled vector. Its
        # sampling_params are the defaults, never used to sample.
        self.pooling_params = pooling_params
        # Its images (engine.multimodal.inputs.MultiModalFeatureSpec), in prompt order: processed tensors, placeholder
        # range and content hash each. Empty for a text-only prompt.
        self.mm_features: list = list(mm_features or ())

        # Its grammar and matcher (StructuredOutputManager.grammar_init compiles it); None without structured outputs.
        self.structured_output_request = (
            None
            if sampling_params.structured_outputs is None
            else StructuredOutputRequest(sampling_params.structured_outputs)
        )
        self.status = RequestStatus.WAITING if self.structured_output_request is None else RequestStatus.WAITING_FOR_FSM
        self.stop_reason: int | str | None = None
        # A request resumed from another engine starts with the output it had there, as one preempted here does.
        self.output_token_ids: list[int] = list(output_token_ids)
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        # Speculative decoding: the drafts proposed to follow all_token_ids, verified in the request's next step.
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        # Prompt tokens served from the prefix cache at first admission (-1: not yet scheduled).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Chained hashes of the request's full blocks, filled in by the KV cache manager.
        self.block_hashes: list[bytes] = []
        self.events: list[EngineCoreEvent] = []
        self.record_event(EngineCoreEventType.QUEUED)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Whether every prompt position must be computed: for its prompt logprobs, or a pooling that reads them."""
        if self.pooling_params is not None:
            return self.pooling_params.skip_reading_prefix_cache
        return self.sampling_params.prompt_logprobs is not None

    def append_output_token_ids(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def record_event(
        self, event_type: EngineCoreEventType, timestamp: float | None = None, num_tokens: int = 0
    ) -> None:
        self.events.append(
            EngineCoreEvent(event_type, time.monotonic() if timestamp is None else timestamp, num_tokens)
        )

    def take_events(self) -> list[EngineCoreEvent]:
        events, self.events = self.events, []
        return events

    def __lt__(self, other: "Request") -> bool:
        # Priority queue order: lower priority value first, then earlier arrival.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )
