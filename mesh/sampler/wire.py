"""The sampler's wire form (llmmesh.v1.Sampler), shared by the engine's client and the sampler service.

Tensors travel as raw row-major bytes with dtype and shape (or, for a service on the engine's host, in shared
memory: mesh.sampler.slots); sampling parameters as SamplerParams.
Everything read from the wire is checked here and a bad value raises ValueError naming its field.
"""

import math
from typing import TYPE_CHECKING

import torch

from engine.request import SamplingParams
from engine.sample.metadata import GrammarBitmask
from engine.sample.rejection_sampler import DraftTokens
from engine.sample.sampler import LogprobsTensors
from engine.serial_utils import tensor_from_bytes, tensor_to_bytes
from engine.spec_decode.config import MAX_SPECULATIVE_TOKENS
from llmmesh.v1 import common_pb2, sampler_pb2

if TYPE_CHECKING:
    from engine.request import Request

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64}
LOGITS_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
# SamplerParams fields that take SamplingParams' default when unset.
_OPTIONAL = ("temperature", "top_p", "repetition_penalty", "seed", "logprobs")


def tensor_to_proto(t: torch.Tensor) -> sampler_pb2.Tensor:
    """One copy to host bytes (a device tensor comes to the host first)."""
    return sampler_pb2.Tensor(dtype=DTYPE_NAMES[t.dtype], shape=t.shape, data=tensor_to_bytes(t).tobytes())


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _length_delimited(field_number: int, length: int) -> bytes:
    return _varint(field_number << 3 | 2) + _varint(length)


def serialize_with_tensors(msg, tensors: dict[str, torch.Tensor | None]) -> bytes:
    """msg's wire bytes with tensors as its Tensor fields (by name), each tensor's memory copied once, straight
    into the result: the same bytes protobuf would write, without its three copies of a large payload."""
    parts = [msg.SerializeToString()]
    fields = msg.DESCRIPTOR.fields_by_name
    data_number = sampler_pb2.Tensor.DESCRIPTOR.fields_by_name["data"].number
    for name, t in tensors.items():
        if t is None:
            continue
        raw = tensor_to_bytes(t)
        header = sampler_pb2.Tensor(dtype=DTYPE_NAMES[t.dtype], shape=t.shape).SerializeToString()
        data_key = _length_delimited(data_number, raw.nbytes)
        parts += [
            _length_delimited(fields[name].number, len(header) + len(data_key) + raw.nbytes),
            header,
            data_key,
            memoryview(raw),
        ]
    return b"".join(parts)


def dtype_and_shape_from_proto(msg, field: str, dtypes=tuple(DTYPES), ndim: int | None = None):
    """A Tensor's or SharedLogits' dtype and shape; ValueError naming field.dtype or field.shape."""
    if msg.dtype not in dtypes:
        raise ValueError(f"{field}.dtype must be one of {', '.join(dtypes)}, got {msg.dtype!r}")
    shape = list(msg.shape)
    if ndim is not None and len(shape) != ndim:
        raise ValueError(f"{field}.shape must have {ndim} dimensions, got {shape}")
    if any(d < 0 for d in shape):
        raise ValueError(f"{field}.shape must not be negative, got {shape}")
    return DTYPES[msg.dtype], shape


def tensor_from_proto(
    msg: sampler_pb2.Tensor,
    field: str,
    dtypes=tuple(DTYPES),
    ndim: int | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """A writable tensor of the message's bytes; ValueError naming field.dtype, field.shape or field.data."""
    dtype, shape = dtype_and_shape_from_proto(msg, field, dtypes, ndim)
    expected = math.prod(shape) * dtype.itemsize
    if len(msg.data) != expected:
        raise ValueError(f"{field}.data holds {len(msg.data)} bytes; shape {shape} of {msg.dtype} needs {expected}")
    return tensor_from_bytes(msg.data, dtype, shape).to(device)


def logprobs_tensors_to_proto(lp: LogprobsTensors) -> sampler_pb2.Logprobs:
    return sampler_pb2.Logprobs(
        token_ids=tensor_to_proto(lp.token_ids), logprobs=tensor_to_proto(lp.logprobs), ranks=tensor_to_proto(lp.ranks)
    )


def logprobs_tensors_from_proto(msg: sampler_pb2.Logprobs, field: str) -> LogprobsTensors:
    return LogprobsTensors(
        tensor_from_proto(msg.token_ids, f"{field}.token_ids", ("int64",), 2),
        tensor_from_proto(msg.logprobs, f"{field}.logprobs", ("float32",), 2),
        tensor_from_proto(msg.ranks, f"{field}.ranks", ("int64",), 1),
    )


def new_request_to_proto(request: "Request") -> sampler_pb2.NewRequest:
    """What the sampler must know of a request the first time it samples for it."""
    p = request.sampling_params
    params = sampler_pb2.SamplerParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p, seed=p.seed,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, min_tokens=p.min_tokens, stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos, eos_token_ids=request.eos_token_ids, logprobs=p.logprobs,
        logit_bias=p.logit_bias or {}, allowed_token_ids=p.allowed_token_ids or [],
        bad_words_token_ids=[common_pb2.TokenIds(ids=w) for w in p.bad_words_token_ids],
    )  # fmt: skip
    prompt = request.prompt_token_ids if p.repetition_penalty != 1.0 else []
    return sampler_pb2.NewRequest(request_id=request.request_id, params=params, prompt_token_ids=prompt)


def sampler_params_from_proto(msg: sampler_pb2.SamplerParams, vocab_size: int, field: str) -> SamplingParams:
    """The request's SamplingParams as far as sampling goes (max_tokens is the engine's business)."""
    try:
        optional = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
        params = SamplingParams(
            top_k=msg.top_k, min_p=msg.min_p, presence_penalty=msg.presence_penalty,
            frequency_penalty=msg.frequency_penalty,
            min_tokens=msg.min_tokens, stop_token_ids=list(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
            max_tokens=None, logit_bias=dict(msg.logit_bias) or None,
            allowed_token_ids=list(msg.allowed_token_ids) or None, **optional,
        )  # fmt: skip
        params.verify_for_model(vocab_size, -1)
    except ValueError as e:
        raise ValueError(f"{field}.{e}") from None
    params.bad_words_token_ids = [list(w.ids) for w in msg.bad_words_token_ids]
    check_wire_token_ids([t for w in params.bad_words_token_ids for t in w], vocab_size, f"{field}.bad_words_token_ids")
    if any(not w for w in params.bad_words_token_ids):
        raise ValueError(f"{field}.bad_words_token_ids: a bad word must have at least one token")
    return params


def check_wire_token_ids(token_ids, vocab_size: int, field: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{field}: token ids must be in [0, {vocab_size}), got {bad[:3]}")


def grammar_bitmask_to_proto(msg: sampler_pb2.SampleStep, grammar: GrammarBitmask | None) -> None:
    """The step's grammar masks into msg: the rows they constrain and their packed bits."""
    if grammar is not None and grammar.rows:
        msg.grammar_rows.extend(grammar.rows)
        msg.grammar_bitmask = tensor_to_bytes(grammar.bitmask).tobytes()


def grammar_bitmask_from_proto(msg: sampler_pb2.SampleStep, num_rows: int, vocab_size: int) -> GrammarBitmask | None:
    """The step's grammar masks; ValueError naming grammar_rows or grammar_bitmask."""
    rows = list(msg.grammar_rows)
    if not rows and not msg.grammar_bitmask:
        return None
    if len(set(rows)) != len(rows) or any(r >= num_rows for r in rows):
        raise ValueError(f"grammar_rows must be distinct rows of logits, in [0, {num_rows}), got {rows[:8]}")
    words = (vocab_size + 31) // 32
    expected = len(rows) * words * 4
    if len(msg.grammar_bitmask) != expected:
        raise ValueError(
            f"grammar_bitmask holds {len(msg.grammar_bitmask)} bytes; {len(rows)} rows of {words} int32 need {expected}"
        )
    return GrammarBitmask(rows, tensor_from_bytes(msg.grammar_bitmask, torch.int32, (len(rows), words)))


def drafts_to_proto(msg: sampler_pb2.SampleStep, drafts: DraftTokens | None) -> None:
    """A step's drafts (speculative decoding) into msg: their count per row, their ids and the draft model's q."""
    if drafts is None:
        return
    msg.num_draft_tokens.extend(len(d) for d in drafts.token_ids)
    msg.draft_token_ids.extend(t for d in drafts.token_ids for t in d)
    if drafts.probs is not None:
        msg.draft_probs.CopyFrom(tensor_to_proto(drafts.probs.float()))


def drafts_from_proto(msg: sampler_pb2.SampleStep, vocab_size: int, device: torch.device) -> DraftTokens | None:
    """The step's drafts; ValueError naming the field. Checked against request_ids and the vocabulary."""
    counts = list(msg.num_draft_tokens)
    if not counts:
        if msg.draft_token_ids or msg.HasField("draft_probs"):
            raise ValueError("draft_token_ids and draft_probs need num_draft_tokens (one entry per request_ids)")
        return None
    if len(counts) != len(msg.request_ids):
        raise ValueError(
            f"num_draft_tokens must have one entry per request_ids ({len(msg.request_ids)}), got {len(counts)}"
        )
    if any(not 0 <= n <= MAX_SPECULATIVE_TOKENS for n in counts) or sum(counts) != len(msg.draft_token_ids):
        raise ValueError(
            f"num_draft_tokens: each in [0, {MAX_SPECULATIVE_TOKENS}], adding up to len(draft_token_ids) "
            f"({len(msg.draft_token_ids)}), got {counts[:8]}"
        )
    check_wire_token_ids(msg.draft_token_ids, vocab_size, "draft_token_ids")
    ids, token_ids, start = list(msg.draft_token_ids), [], 0
    for n in counts:
        token_ids.append(ids[start : start + n])
        start += n
    probs = None
    if msg.HasField("draft_probs"):
        probs = tensor_from_proto(msg.draft_probs, "draft_probs", ("float32",), 2, device)
        if tuple(probs.shape) != (len(ids), vocab_size):
            raise ValueError(f"draft_probs.shape must be [{len(ids)} drafts, {vocab_size}], got {list(probs.shape)}")
    return DraftTokens(token_ids, probs)
