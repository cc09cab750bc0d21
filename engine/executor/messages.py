"""What crosses from rank 0 to the other ranks, without pickle: a JSON header naming each value, then the raw
bytes of its tensors. Values are None, bools, numbers, strings, lists and dicts of them, tensors, and the
dataclasses named in DATACLASSES (whose fields are such values)."""

import dataclasses
import json
import struct

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata

DATACLASSES = {cls.__name__: cls for cls in (AttentionMetadata,)}
_HEADER = struct.Struct("<Q")


def encode(message: dict) -> bytes:
    tensors: list[torch.Tensor] = []

    def walk(value):
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        if isinstance(value, torch.Tensor):
            tensors.append(value.detach().to("cpu").contiguous())
            t = tensors[-1]
            return {"tensor": len(tensors) - 1, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        if isinstance(value, (list, tuple)):
            return {"list": [walk(v) for v in value]}
        if isinstance(value, dict):
            return {"dict": {str(k): walk(v) for k, v in value.items()}}
        if dataclasses.is_dataclass(value) and type(value).__name__ in DATACLASSES:
            fields = {f.name: walk(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return {"dataclass": type(value).__name__, "fields": fields}
        raise TypeError(f"cannot send a {type(value).__name__} to the other ranks")

    header = json.dumps(walk(message)).encode()
    body = [t.reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors]
    return b"".join([_HEADER.pack(len(header)), header, *body])


def decode(data: bytes, device: torch.device) -> dict:
    (n,) = _HEADER.unpack_from(data)
    header = json.loads(data[_HEADER.size : _HEADER.size + n])
    offset = _HEADER.size + n

    def tensor(spec) -> torch.Tensor:
        nonlocal offset
        dtype = getattr(torch, spec["dtype"])
        size = dtype.itemsize
        for d in spec["shape"]:
            size *= d
        # Copied into torch's own (aligned) memory: kernels may read a tensor with aligned vector loads.
        flat = torch.empty(size, dtype=torch.uint8)
        flat.numpy()[:] = np.frombuffer(data, np.uint8, size, offset)
        offset += size
        return flat.view(dtype).reshape(spec["shape"]).to(device)

    def walk(value):
        if not isinstance(value, dict):
            return value
        if "tensor" in value:  # met in the order encode() appended them
            return tensor(value)
        if "list" in value:
            return [walk(v) for v in value["list"]]
        if "dict" in value:
            return {k: walk(v) for k, v in value["dict"].items()}
        return DATACLASSES[value["dataclass"]](**{k: walk(v) for k, v in value["fields"].items()})

    return walk(header)
