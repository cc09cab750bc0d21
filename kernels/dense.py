"""dense_linear (kernels/cpu/dense.cpp): bfloat16 x @ w.T (+ bias) for a decode step's few rows, read from the
weight oneDNN packed for the many-row path, so the model keeps one copy of each weight.

oneDNN packs a bfloat16 weight [N, K] as AB16b32a2b: tiles of 32 output columns, each tile's pairs of inputs in
order, a pair the 32 columns' two weights; K and N padded with zeros to multiples of 32. packed_view() sees that
buffer as the tensor dense_linear reads, [N / 32, K / 2, 32, 2], after checking it holds exactly pack_dense()'s
bytes: a oneDNN that packs otherwise gets None, and the layer stays on oneDNN alone.
"""

import ctypes
import functools

import torch
import torch.nn.functional as F

TILE = 32  # output columns a tile


def pack_dense(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] in dense_linear's layout, [N / 32, K / 2, 32, 2] with N and K padded to multiples of 32."""
    n, k = w.shape
    w = F.pad(w, (0, -k % TILE, 0, -n % TILE))
    return w.reshape(w.shape[0] // TILE, TILE, w.shape[1] // 2, 2).transpose(1, 2).contiguous()


def packed_view(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed bfloat16 weight (torch.ops.mkldnn._reorder_linear_weight of weight) as pack_dense(weight),
    sharing its memory, or None if its bytes are laid out otherwise. The view keeps packed alive."""
    expected = pack_dense(weight)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if nbytes != expected.numel() * expected.element_size():
        return None
    buffer = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    buffer.owner = packed
    view = torch.frombuffer(buffer, dtype=torch.bfloat16).view(expected.shape)
    return view if torch.equal(view.view(torch.int16), expected.view(torch.int16)) else None


@functools.cache  # asked once a layer at load: a machine that cannot build the kernels tries once
def dense_kernel():
    """dense_linear (x, packed, n, bias) -> x @ w.T + bias for bfloat16 x and a packed_view weight of n output
    columns, or None where the CPU kernels cannot be built or the CPU has no AVX512-BF16."""
    try:
        from kernels.cpu_ops import load

        load()  # registers torch.ops.llmmesh_dense
    except Exception:  # noqa: BLE001 (a machine that cannot build them keeps oneDNN)
        return None
    return torch.ops.llmmesh_dense.dense_linear if torch.ops.llmmesh_dense.dense_supported() else None
