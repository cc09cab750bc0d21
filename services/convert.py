"""llmmesh.v1 messages <-> the engine library's Python types (the Gateway's and the Engine's protocol), in one place.

The other protocols have their own modules: vLLM's VllmEngine in services/vllm_convert.py, the sampler's in
mesh/sampler/wire.py.
"""

import math
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


# ---- images (MultiModalInput <-> engine.multimodal.inputs.MultiModalFeatureSpec) -----------------------------------

# The dtypes a processed image's tensors travel as.
TENSOR_DTYPES = ("float32", "float16", "bfloat16", "int64", "int32", "uint8")


def tensor_to_llmmesh(tensor) -> common_pb2.TensorData:
    """Raw bytes in the tensor's own dtype (viewed as bytes: numpy has no bfloat16)."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    data = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return common_pb2.TensorData(data=data, dtype=str(tensor.dtype).removeprefix("torch."), shape=tensor.shape)


def tensor_from_llmmesh(msg: common_pb2.TensorData, where: str):
    import torch

    if msg.dtype not in TENSOR_DTYPES:
        raise ValueError(f"{where}.dtype: {msg.dtype[:32]!r} is not one of {', '.join(TENSOR_DTYPES)}")
    shape, dtype = tuple(msg.shape), getattr(torch, msg.dtype)
    if any(d < 0 for d in shape):
        raise ValueError(f"{where}.shape: {list(shape)} has a negative size")
    expected = math.prod(shape) * dtype.itemsize
    if len(msg.data) != expected:
        raise ValueError(
            f"{where}.data: {len(msg.data)} bytes, but shape {list(shape)} of {msg.dtype} takes {expected}"
        )
    if not expected:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(msg.data), dtype=torch.uint8).view(dtype).reshape(shape)


def mm_features_to_llmmesh(features) -> list[common_pb2.MultiModalInput]:
    return [
        common_pb2.MultiModalInput(
            modality=f.modality,
            data={name: tensor_to_llmmesh(t) for name, t in f.data.items()},
            mm_position=common_pb2.PlaceholderRange(offset=f.mm_position.offset, length=f.mm_position.length),
            identifier=f.identifier,
        )
        for f in features
    ]


def mm_features_from_llmmesh(inputs, field: str = "mm_inputs") -> list:
    """The engine's MultiModalFeatureSpecs; the tensors' bytes are checked against their shapes here, the rest
    (tensors against the model, ranges against the prompt) by the engine's processor. An input without an
    identifier is named by its tensors' content hash."""
    from engine.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange, hash_tensors

    features = []
    for i, m in enumerate(inputs):
        where = f"{field}[{i}]"
        if m.modality not in ("", "image"):
            raise ValueError(f"{where}.modality: {m.modality[:32]!r} is not supported; image is")
        data = {name: tensor_from_llmmesh(t, f"{where}.data[{name[:64]!r}]") for name, t in m.data.items()}
        position = PlaceholderRange(m.mm_position.offset, m.mm_position.length)
        features.append(MultiModalFeatureSpec(data, m.identifier or hash_tensors(data), position))
    return features
