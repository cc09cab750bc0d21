"""llmmesh.v1 messages <-> the engine library's Python types (the Gateway's and the Engine's protocol), in one place.

The other protocols have their own modules: vLLM's VllmEngine in services/vllm_convert.py, the sampler's in
mesh/sampler/wire.py.
"""

import time

from engine.outputs import Logprob, RequestMetrics, RequestOutput
from engine.request import SamplingParams, StructuredOutputsParams
from llmmesh.v1 import common_pb2, engine_pb2

# Proto fields copied as they are when set (optional scalars).
_OPTIONAL_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "max_tokens",
    "seed",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
)


def sampling_params_from_llmmesh(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take vLLM's defaults; a bad value raises ValueError naming the field."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_llmmesh(msg.structured_outputs)
    return SamplingParams(
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        bad_words=list(msg.bad_words),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        **kwargs,
    )


def structured_outputs_from_llmmesh(msg: common_pb2.StructuredOutputsParams) -> StructuredOutputsParams:
    """The constraint set; ValueError naming structured_outputs when there is none."""
    kind = msg.WhichOneof("constraint")
    constraint = {} if kind is None else {kind: list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)}
    return StructuredOutputsParams(**constraint, disable_any_whitespace=msg.disable_any_whitespace)


def logprobs_to_llmmesh(positions: list[dict[int, Logprob] | None]) -> list[common_pb2.PositionLogprobs]:
    """vLLM-style [{token_id: Logprob}] -> PositionLogprobs; a None position (the first prompt token) is skipped."""
    return [
        common_pb2.PositionLogprobs(
            entries=[
                common_pb2.TokenLogprob(
                    token_id=t, logprob=lp.logprob, rank=lp.rank or 0, decoded_token=lp.decoded_token or ""
                )
                for t, lp in entry.items()
            ]
        )
        for entry in positions
        if entry is not None
    ]


def timings_to_llmmesh(m: RequestMetrics) -> common_pb2.Timings:
    """A request's timings so far; what is not known yet is 0."""
    return common_pb2.Timings(
        queue_time=m.time_in_queue or 0.0,
        time_to_first_token=m.time_to_first_token or 0.0,
        e2e_latency=time.monotonic() - m.arrival_time,
        prefill_time=m.prefill_time or 0.0,
        decode_time=m.decode_time or 0.0,
    )


def request_output_to_llmmesh(out: RequestOutput, first_tokens: bool) -> engine_pb2.EngineGenerateResponse:
    """One step's RequestOutput (delta) -> one Engine/Generate message with every completion that moved."""
    msg = engine_pb2.EngineGenerateResponse()
    for c in out.outputs:
        delta = msg.outputs.add(index=c.index, token_ids=c.token_ids, finish_reason=c.finish_reason or "")
        if c.logprobs:
            delta.logprobs.extend(logprobs_to_llmmesh(c.logprobs))
        if isinstance(c.stop_reason, str):
            delta.stop_str = c.stop_reason
        elif c.stop_reason is not None:
            delta.stop_token_id = c.stop_reason
    if out.prompt_logprobs:
        msg.prompt_logprobs.extend(logprobs_to_llmmesh(out.prompt_logprobs))
    if first_tokens:
        msg.num_prompt_tokens = len(out.prompt_token_ids)
    if out.finished:
        msg.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=out.metrics.num_generation_tokens,
                cached_tokens=out.num_cached_tokens,
            )
        )
    # The first tokens' message carries the timings too: a caller that stops reading early, at a stop
    # string, still has the queue time and the time to first token.
    if out.finished or first_tokens:
        msg.timings.CopyFrom(timings_to_llmmesh(out.metrics))
    return msg
