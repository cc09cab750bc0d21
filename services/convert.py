"""Protobuf messages <-> the library's Python types, in one place."""

from engine.outputs import Logprob
from engine.request import SamplingParams
from llmmesh.v1 import common_pb2

# Proto fields copied as they are when set (optional scalars).
_OPTIONAL_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "max_tokens", "seed", "skip_special_tokens",
    "spaces_between_special_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens",
)


def sampling_params_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take vLLM's defaults; a bad value raises ValueError naming the field."""
    kwargs = {name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)}
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    if msg.allowed_token_ids:
        kwargs["allowed_token_ids"] = list(msg.allowed_token_ids)
    return SamplingParams(
        stop=list(msg.stop),
        stop_token_ids=list(msg.stop_token_ids),
        bad_words=list(msg.bad_words),
        ignore_eos=msg.ignore_eos,
        include_stop_str_in_output=msg.include_stop_str_in_output,
        **kwargs,
    )


def logprobs_to_proto(positions: list[dict[int, Logprob] | None]) -> list[common_pb2.PositionLogprobs]:
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
