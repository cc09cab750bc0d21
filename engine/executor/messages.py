"""What crosses between rank 0 and the other ranks, without pickle: a JSON header naming each value, then the raw
bytes of its tensors. Values are None, bools, numbers, strings, bytes, lists and dicts of them, tensors, and
dataclasses whose fields are such values (a KV connector's metadata, a LoRARequest). A dataclass is named by its
module and class; the receiving side builds it only from a module it has imported already, never importing one.

Each step's SchedulerOutput crosses as scheduler_output_to_wire writes it (vLLM's new and cached requests: a
request's prompt the first time a rank sees it, then only the tokens it has not seen), and every rank rebuilds
the same SchedulerOutput over request states of its own (scheduler_output_from_wire)."""

import dataclasses
import json
import sys

import torch

from engine.framing import FRAME_LENGTH
from engine.request import Request, SamplingParams
from engine.sched.output import SchedulerOutput
from engine.serial_utils import tensor_from_bytes, tensor_to_bytes


def encode(message: dict) -> bytes:
    tensors: list = []  # each one's bytes, in the order the header numbers them

    def walk(value):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, bytes):
            return {"bytes": value.hex()}
        if isinstance(value, torch.Tensor):
            tensors.append(tensor_to_bytes(value))
            return {
                "tensor": len(tensors) - 1,
                "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape),
            }
        if isinstance(value, (list, tuple, set)):
            return {"list": [walk(v) for v in value]}
        if isinstance(value, dict):  # keys of any kind (a store job's int id), so as pairs
            return {"dict": [[walk(k), walk(v)] for k, v in value.items()]}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            cls = type(value)
            fields = {f.name: walk(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
            return {"dataclass": [cls.__module__, cls.__qualname__], "fields": fields}
        raise TypeError(f"cannot send a {type(value).__name__} to the other ranks")

    header = json.dumps(walk(message)).encode()
    return b"".join([FRAME_LENGTH.pack(len(header)), header, *tensors])  # the header framed, then the tensors


def decode(data: bytes, device: torch.device) -> dict:
    (n,) = FRAME_LENGTH.unpack_from(data)
    if n > len(data) - FRAME_LENGTH.size:
        raise ValueError(f"a message's header claims {n} bytes, more than the {len(data)} received")
    header = json.loads(data[FRAME_LENGTH.size : FRAME_LENGTH.size + n])
    offset = FRAME_LENGTH.size + n

    def tensor(spec) -> torch.Tensor:
        nonlocal offset
        dtype = getattr(torch, spec["dtype"])
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"a message names no dtype {spec['dtype']!r}")
        t = tensor_from_bytes(data, dtype, spec["shape"], offset)
        offset += t.nbytes
        return t.to(device)

    def walk(value):
        if not isinstance(value, dict):
            return value
        if "tensor" in value:  # met in the order encode() appended them
            return tensor(value)
        if "bytes" in value:
            return bytes.fromhex(value["bytes"])
        if "list" in value:
            return [walk(v) for v in value["list"]]
        if "dict" in value:
            return {_hashable(walk(k)): walk(v) for k, v in value["dict"]}
        return _dataclass(*value["dataclass"])(**{k: walk(v) for k, v in value["fields"].items()})

    return walk(header)


def _hashable(key):
    return tuple(key) if isinstance(key, list) else key


def _dataclass(module: str, qualname: str) -> type:
    cls = sys.modules.get(module)
    for name in qualname.split("."):
        cls = getattr(cls, name, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"a message names {module}.{qualname}, which is no dataclass this process has imported")
    return cls


def scheduler_output_to_wire(so: SchedulerOutput, sent: dict[str, int], with_sampling: bool = False) -> dict:
    """so for the other ranks. sent: request id -> how many of its tokens they hold (updated here). with_sampling:
    a new request's sampling parameters and EOS tokens go too, for a rank that samples (pipeline parallelism's
    last stage); the other ranks read only its prompt logprobs."""
    for request_id in so.finished_req_ids:
        sent.pop(request_id, None)
    new_reqs, cached_reqs = [], []
    for r in so.scheduled_requests:
        known = sent.get(r.request_id)
        if known is None:  # vLLM's NewRequestData: what the runner reads of a request
            new_reqs.append(
                {
                    "req_id": r.request_id,
                    "prompt_token_ids": r.prompt_token_ids,
                    "output_token_ids": r.output_token_ids,
                    "prompt_logprobs": r.sampling_params.prompt_logprobs,
                    "lora_request": r.lora_request,
                    "num_computed_tokens": r.num_computed_tokens,
                }
            )
            if with_sampling:
                new_reqs[-1].update(sampling_params=r.sampling_params, eos_token_ids=list(r.eos_token_ids))
        else:  # vLLM's CachedRequestData: the tokens sampled since the rank last saw it
            new_token_ids = r.all_token_ids[known:]
            cached_reqs.append([r.request_id, new_token_ids, r.num_computed_tokens])
        sent[r.request_id] = r.num_tokens
    return {
        "scheduled_new_reqs": new_reqs,
        "scheduled_cached_reqs": cached_reqs,
        "order": [r.request_id for r in so.scheduled_requests],
        "num_scheduled_tokens": so.num_scheduled_tokens,
        "total_num_scheduled_tokens": so.total_num_scheduled_tokens,
        "block_ids": so.block_ids,
        "preempted_req_ids": so.preempted_req_ids,
        "finished_req_ids": so.finished_req_ids,
        "kv_connector_metadata": so.kv_connector_metadata,
        "structured_output_request_ids": so.structured_output_request_ids,
        "grammar_bitmask": so.grammar_bitmask,
        "scheduled_spec_decode_tokens": so.scheduled_spec_decode_tokens,
    }


def scheduler_output_from_wire(wire: dict, states: dict[str, Request]) -> SchedulerOutput:
    """The SchedulerOutput rank 0 sent, over this rank's request states (request id -> Request, updated here)."""
    for request_id in wire["finished_req_ids"]:
        states.pop(request_id, None)
    for new in wire["scheduled_new_reqs"]:
        params = new.get("sampling_params") or SamplingParams(prompt_logprobs=new["prompt_logprobs"])
        eos = new.get("eos_token_ids", ())
        request = Request(new["req_id"], new["prompt_token_ids"], params, eos, lora_request=new["lora_request"])
        for token_id in new["output_token_ids"]:
            request.append_output_token_ids(token_id)
        request.num_computed_tokens = new["num_computed_tokens"]
        states[request.request_id] = request
    for request_id, new_token_ids, num_computed_tokens in wire["scheduled_cached_reqs"]:
        request = states[request_id]
        for token_id in new_token_ids:
            request.append_output_token_ids(token_id)
        request.num_computed_tokens = num_computed_tokens
    return SchedulerOutput(
        scheduled_requests=[states[request_id] for request_id in wire["order"]],
        num_scheduled_tokens=wire["num_scheduled_tokens"],
        total_num_scheduled_tokens=wire["total_num_scheduled_tokens"],
        block_ids=wire["block_ids"],
        preempted_req_ids=set(wire["preempted_req_ids"]),
        finished_req_ids=set(wire["finished_req_ids"]),
        kv_connector_metadata=wire["kv_connector_metadata"],
        structured_output_request_ids=wire["structured_output_request_ids"],
        grammar_bitmask=wire["grammar_bitmask"],
        scheduled_spec_decode_tokens=wire["scheduled_spec_decode_tokens"],
    )
