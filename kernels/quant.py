"""Group-wise quantized weights: the one format, its quantizers, torch references, and the kernels that run it.

A weight [N, K] is held as integer codes q [N, K] (int8) with float32 scales and zeros [N, K // group_size]:
w[n, k] = q[n, k] * scales[n, g] + zeros[n, g], with g = k // group_size. GGUF's Q8_0, Q4_0, Q4_1, Q4_K and
Q6_K blocks are exactly of this form, and so are the int8 (symmetric) and int4 (asymmetric) weight-only methods.

Kernels: PyTorch's packed ones. 4-bit codes run on its int4 matmul (CPU: `_weight_int4pack_mm_for_cpu`, CUDA:
`_weight_int4pack_mm`), int8 codes with one scale per row on `_weight_int8pack_mm`. On CPU both are fast for
a decode step's few rows in bfloat16 and slow in float32 or for many rows, where oneDNN's matmul on the
dequantized weight wins (docs/benchmarks.md); engine/models/quantization.py chooses between them. Codes in groups
that neither takes (GGUF's Q6_K) run on our CPU kernel for few rows, `group_gemv` (kernels/cpu/quant.cpp).
Where the CPU has AVX512-VNNI or AVX2, bfloat16 steps run codes in groups of 32 (GGUF's Q4_0, Q4_1, Q8_0; int4) on
`int8_dot_linear` instead: the activations rounded to int8 per block of 32, as llama.cpp does, and integer dot
products, faster than PyTorch's int4 kernel at a few rows (docs/benchmarks.md).
"""

import torch
import torch.nn.functional as F

# Group sizes PyTorch's int4 kernels take.
INT4_GROUP_SIZES = (32, 64, 128, 256)


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The float32 weight [N, K] the codes stand for (each element one float32 multiply-add, as GGUF's own)."""
    n, k = q.shape
    groups = q.float().view(n, scales.shape[1], -1)  # broadcast the groups' scales and zeros, not repeat them
    return (groups * scales[..., None] + zeros[..., None]).view(n, k)


class DequantizedExperts:
    """Stacked experts' codes, scales and zeros ([E, N, K], [E, N, K // group_size]) that dequantize one expert when
    indexed, to `dtype`: the torch experts (fused_experts) read only the experts a step routes to."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype):
        self.q, self.scales, self.zeros, self.dtype = q, scales, zeros, dtype
        self.shape = q.shape

    def __getitem__(self, expert: int) -> torch.Tensor:
        return dequantize(self.q[expert], self.scales[expert], self.zeros[expert]).to(self.dtype)


def group_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The reference every quantized kernel is held to: x @ w.T in float32 on the dequantized weight."""
    return F.linear(x.float(), dequantize(q, scales, zeros)).to(x.dtype)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"input size {k} is not a multiple of the quantization group size {group_size}")
    return w.float().reshape(n, k // group_size, group_size)


def quantize_int8(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes in [-127, 127], one scale per group (absmax / 127), zeros 0."""
    g = _groups(w, group_size)
    scales = g.abs().amax(-1) / 127
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round(g / scales[..., None]).clamp(-127, 127).to(torch.int8).reshape(w.shape)
    return q, scales, torch.zeros_like(scales)


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes in [0, 15]: each group's minimum is its zero, (max - min) / 15 its scale, both
    rounded to float16 values (as GGUF's 4-bit blocks hold them, which int8_dot_linear reads)."""
    g = _groups(w, group_size)
    low, high = g.amin(-1).half().float(), g.amax(-1)
    scales = ((high - low) / 15).half().float()
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    q = torch.round((g - low[..., None]) / scales[..., None]).clamp(0, 15).to(torch.int8).reshape(w.shape)
    return q, scales, low


def is_int4(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether PyTorch's int4 kernels can run these codes: all in [0, 15], in a group size they take."""
    return q.shape[1] // scales.shape[1] in INT4_GROUP_SIZES and bool(q.min() >= 0) and bool(q.max() <= 15)


def int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[groups, N, 2] for PyTorch's int4 kernels, which compute (q - 8) * scale + zero: the zero moves by 8 scales."""
    return torch.stack([scales, zeros + 8 * scales], dim=-1).transpose(0, 1).contiguous().to(dtype)


def pack_int4(q: torch.Tensor, device: torch.device, inner_k_tiles: int = 8) -> torch.Tensor:
    """The codes [N, K] in the device's packed int4 layout."""
    if device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    pairs = q.to(torch.uint8)
    packed = (pairs[:, ::2] << 4 | pairs[:, 1::2]).contiguous().to(device)
    return torch.ops.aten._convert_weight_to_int4pack(packed, inner_k_tiles)


def int4_linear(x: torch.Tensor, packed: torch.Tensor, group_size: int, scales_and_zeros: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros)
    return torch.ops.aten._weight_int4pack_mm(x, packed, group_size, scales_and_zeros)


def is_int8_per_row(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether `_weight_int8pack_mm` can run these codes: one scale per row, no zeros."""
    return scales.shape[1] == 1 and not bool(zeros.any())


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return torch.ops.aten._weight_int8pack_mm(x, q, scales)


def group_gemv_kernel():
    """Our CPU kernel for codes in groups of 16 or 32 that PyTorch's kernels cannot run (kernels/cpu/quant.cpp:
    GGUF's Q8_0 and Q6_K): (x, q, scales, zeros) -> x @ w.T, or None where the CPU kernels cannot be built."""
    from kernels.cpu_ops import try_load

    return torch.ops.llmmesh_quant.group_gemv if try_load() is not None else None


# int8_dot_linear (kernels/cpu/quant.cpp): codes in groups of 32 against activations quantized to int8 per block
# of 32, integer dot products (AVX512-VNNI, or AVX2 with FMA and F16C), the weight read once for all of a step's
# rows. Output columns go in tiles of 16, one int32 lane a column.
INT8_DOT_GROUP, INT8_DOT_TILE = 32, 16


def quantize_rows_int8(x: torch.Tensor) -> torch.Tensor:
    """x as int8_dot_linear sees it: each block of 32 rounded to int8 codes times absmax / 127 (llama.cpp's q8)."""
    blocks = x.float().reshape(x.shape[0], -1, INT8_DOT_GROUP)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inverse).clamp(-127, 127) * (amax / 127)).reshape(x.shape)


def int8_dot_linear_ref(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """int8_dot_linear's reference: the dequantized weight against the int8-rounded activations, in float32."""
    return F.linear(quantize_rows_int8(x), dequantize(q, scales, zeros)).to(x.dtype)


def int8_dot_takes(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether int8_dot_linear can run these codes: groups of 32 (any int8 codes: 4-bit ones in [0, 15] pack
    two a byte)."""
    return q.shape[1] // scales.shape[1] == INT8_DOT_GROUP


def pack_int8_dot(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(packed, n): the weight in int8_dot_linear's layout (kernels/cpu/quant.cpp), one uint8 tensor [tiles,
    groups, bytes] of each tile's groups in order, a group its codes, then its 16 scales and 16 zeros (float16).
    4-bit codes [0, 15] go two a byte; other int8 codes plus 128, their zero moved by -128 scales. Columns are
    padded to whole tiles. None where a scale or zero is no float16 value (GGUF's are; int4's are made so)."""
    n, k = q.shape
    groups, tiles = k // INT8_DOT_GROUP, -(-n // INT8_DOT_TILE)
    four_bit = bool(q.min() >= 0) and bool(q.max() <= 15)
    u = q.to(torch.int16) if four_bit else q.to(torch.int16) + 128
    scales, zeros = scales.float(), zeros.float() if four_bit else zeros.float() - 128 * scales.float()
    if not all(torch.equal(t.half().float(), t) for t in (scales, zeros)):
        return None
    pad = tiles * INT8_DOT_TILE - n
    u, scales, zeros = (F.pad(t, (0, 0, 0, pad)) for t in (u, scales, zeros))
    if four_bit:  # chunk c of a group, byte 4j + i: column j's k = 8c + i (low nibble) and 8c + 4 + i (high)
        u = u.reshape(tiles, INT8_DOT_TILE, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
        u = u[..., 0] | u[..., 1] << 4
    else:  # chunk c of a group, byte 4j + i: column j's k = 4c + i
        u = u.reshape(tiles, INT8_DOT_TILE, groups, 8, 4).permute(0, 2, 3, 1, 4)
    codes = u.to(torch.uint8).reshape(tiles, groups, -1)

    def per_group(t):  # [tiles, groups, 16 float16] as bytes
        return t.half().reshape(tiles, INT8_DOT_TILE, groups).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([codes, per_group(scales), per_group(zeros)], dim=-1).contiguous(), n


def int8_dot_kernel():
    """int8_dot_linear (x, packed, n) -> x @ w.T, or None where the CPU kernels cannot be built or
    the CPU has neither AVX512-VNNI nor AVX2 with FMA and F16C."""
    gemv = group_gemv_kernel()
    if gemv is None or not torch.ops.llmmesh_quant.int8_dot_supported():
        return None
    return torch.ops.llmmesh_quant.int8_dot_linear
