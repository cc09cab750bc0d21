"""Tensors as raw row-major bytes, without pickle: the executor's messages and the sampler's wire both use this.

The dtype and shape travel beside the bytes, in the message that holds them.
"""

import math

import numpy as np
import torch


def tensor_to_bytes(t: torch.Tensor) -> np.ndarray:
    """t's row-major bytes on the host, as a uint8 array (a device tensor comes to the host first)."""
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()


def tensor_from_bytes(data, dtype: torch.dtype, shape, offset: int = 0) -> torch.Tensor:
    """A tensor of dtype and shape from data's bytes at offset; ValueError when data holds fewer.

    Copied into torch's own (aligned) memory: kernels may read a tensor with aligned vector loads."""
    size = math.prod(shape) * dtype.itemsize
    if not 0 <= size <= len(data) - offset:  # checked before anything of that size is allocated
        raise ValueError(f"a tensor of shape {list(shape)} is larger than the bytes received")
    flat = torch.empty(size, dtype=torch.uint8)
    flat.numpy()[:] = np.frombuffer(data, np.uint8, size, offset)
    return flat.view(dtype).reshape(shape)
