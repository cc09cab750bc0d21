"""dense_linear (kernels/cpu/dense.cpp): bfloat16 or float32 x @ w.T (+ bias) for a decode step's few rows, read
from the weight oneDNN packed for the many-row path, so the model keeps one copy of each weight.

oneDNN packs a bfloat16 weight [N, K] as AB16b32a2b on CPUs with AMX and AB16b64a2b on those without: tiles of T =
32 or 64 output columns, each tile's pairs of inputs in order, a pair the T columns' two weights; K padded with zeros
to a multiple of 32, N to one of T. It packs a float32 weight in tiles of 64 output columns, each tile's inputs in
order, an input the 64 columns' weights; K padded with zeros to a multiple of 16, N to one of 64. packed_view() sees
that buffer as the tensor dense_linear reads, [N / T, K / 2, T, 2] or [N / 64, K, 64], after checking, once a shape
and dtype, that oneDNN packs a weight of that shape as pack_dense() does with one of those tiles: a oneDNN that packs
otherwise gets None, and the layer stays on oneDNN alone.

dense_codes_linear: float32 x @ w.T for a quantized layer's few rows, read from its group-quantized codes in
pack_codes' layout (4-bit codes two a byte, so with their float16 scales about a sixth of the float32 weight's bytes;
8-bit ones a quarter or more), each weight formed with the bits of kernels/quant.py's dequantize() and each column
summed as dense_linear's AVX2 form sums it: the dequantized weight's bits, checked at load
(engine/models/quantization.py).
"""

import ctypes
import functools
import math

import torch
import torch.nn.functional as F

# Output columns a bfloat16 tile, the one oneDNN used last first (one CPU packs every weight alike: one comparison
# a weight); its K is padded to a multiple of K_BLOCK.
TILES = [32, 64]
K_BLOCK = 32
TILE_F32, K_BLOCK_F32 = 64, 16  # output columns a float32 tile; its K is padded to a multiple of K_BLOCK_F32


def packed_shape(shape, dtype: torch.dtype, tile: int = 32) -> tuple[int, ...]:
    """pack_dense's shape for a weight of shape [N, K]: bfloat16 [N / tile, K / 2, tile, 2] with N padded to a multiple
    of tile and K to one of 32, float32 [N / 64, K, 64] with N padded to a multiple of 64 and K to one of 16."""
    n, k = shape
    if dtype == torch.float32:
        return -(-n // TILE_F32), k + -k % K_BLOCK_F32, TILE_F32
    return -(-n // tile), (k + -k % K_BLOCK) // 2, tile, 2


def pack_dense(w: torch.Tensor, tile: int = 32) -> torch.Tensor:
    """w [N, K] in dense_linear's layout, of packed_shape."""
    n, k = w.shape
    dims = packed_shape(w.shape, w.dtype, tile)
    tiles, columns = dims[0], dims[2]
    w = F.pad(w, (0, math.prod(dims[1:]) // columns - k, 0, tiles * columns - n))  # K and N padded
    return w.reshape(tiles, columns, dims[1], -1).transpose(1, 2).contiguous().view(dims)


def pack_codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple:
    """Group-quantized codes q [N, K] (int8) with float32 scales and zeros [N, K / group_size] (kernels/quant.py) as
    dense_codes_linear takes them: (codes, scales, zeros, products_exact), in tiles of 64 output columns, N padded
    with zero codes, scales and zeros. Codes all in [0, 15] go two a byte, uint8 [N / 64, K, 32] (columns j and
    j + 32 in a byte's low and high nibbles), others as int8 [N / 64, K, 64]; scales and zeros [N / 64, groups, 64]
    go as float16 where every one of them is a float16 value (GGUF's 4-bit blocks, int4), else as float32."""
    tiles = -(-q.shape[0] // TILE_F32)

    def tiled(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        t = F.pad(t.to(dtype), (0, 0, 0, tiles * TILE_F32 - t.shape[0]))
        return t.reshape(tiles, TILE_F32, -1).transpose(1, 2).contiguous()

    codes = tiled(q, torch.int8)
    if bool(q.min() >= 0) and bool(q.max() <= 15):
        codes = (codes[..., : TILE_F32 // 2] | (codes[..., TILE_F32 // 2 :] << 4)).view(torch.uint8)
    dtype = torch.float16 if all(torch.equal(t.half().float(), t) for t in (scales, zeros)) else torch.float32
    return codes, tiled(scales, dtype), tiled(zeros, dtype), products_exact(q, scales)


def products_exact(q: torch.Tensor, scales: torch.Tensor) -> bool:
    """Whether every code times its scale is exact in float32: the codes' bits and the scales' significant bits
    add up to at most 24 (a 4-bit code times a float16 scale takes 15), all far from float32's limits. Then one fused
    multiply-add forms a weight with the bits of dequantize()'s product rounded, then added."""
    s = scales.abs()
    s = s[s != 0]
    if s.numel() == 0:
        return True
    if bool(s.min() < 2.0**-100) or bool(s.max() > 2.0**100):
        return False
    significand = (torch.frexp(s).mantissa.double() * 2.0**24).to(torch.int64)  # 24 bits, exactly
    scale_bits = 24 - int(torch.log2((significand & -significand).double()).min())  # less the trailing zeros
    code_bits = max(int(q.max()), -int(q.min())).bit_length()
    return scale_bits + code_bits <= 24


def packed_view(packed: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed bfloat16 or float32 weight (torch.ops.mkldnn._reorder_linear_weight of weight) as
    pack_dense(weight) for one of the layouts dense_linear reads, sharing its memory, or None if oneDNN lays out
    weights of its shape otherwise. The view keeps packed alive."""
    tile = _onednn_tile(tuple(weight.shape), weight.dtype)
    return None if tile is None else _view(packed, weight.shape, weight.dtype, tile)


@functools.cache
def _onednn_tile(shape: tuple[int, int], dtype: torch.dtype) -> int | None:
    """The tile of pack_dense's layout that oneDNN packs weights of this shape and dtype in, found by packing a random
    weight of the shape and comparing bit for bit (the layout is oneDNN's choice for the shape, not the values: one
    check a shape, not a second copy of every weight); None when it is none of them."""
    probe = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(probe, None)
    for tile in [TILE_F32] if dtype == torch.float32 else list(TILES):
        view, expected = _view(packed, shape, dtype, tile), pack_dense(probe, tile)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        if view is not None and torch.equal(view.view(bits), expected.view(bits)):
            if tile in TILES:
                TILES.sort(key=lambda t: t != tile)
            return tile
    return None


def _view(packed: torch.Tensor, shape, dtype: torch.dtype, tile: int) -> torch.Tensor | None:
    """packed's buffer as pack_dense's tensor of a weight of shape in tiles of tile columns, or None when its size
    is not that tensor's."""
    dims = packed_shape(shape, dtype, tile)
    nbytes = torch.ops.mkldnn._nbytes(packed)
    if nbytes != math.prod(dims) * dtype.itemsize:
        return None
    buffer = (ctypes.c_char * nbytes).from_address(torch.ops.mkldnn.data_ptr(packed))
    buffer.owner = packed
    return torch.frombuffer(buffer, dtype=dtype).view(dims)


@functools.cache  # asked once a layer at load
def dense_kernel(dtype: torch.dtype = torch.bfloat16):
    """dense_linear (x, packed, n, bias) -> x @ w.T + bias for x of dtype (bfloat16 or float32) and a packed_view
    weight of n output columns, or None where the CPU kernels cannot be built or the CPU lacks AVX-512 or AVX2 with
    FMA (AVX512-BF16 for bfloat16)."""
    from kernels.cpu_ops import try_load

    supported = try_load() is not None and dtype in (torch.bfloat16, torch.float32)
    return (
        torch.ops.llmmesh_dense.dense_linear if supported and torch.ops.llmmesh_dense.dense_supported(dtype) else None
    )


@functools.cache
def dense_codes_kernel():
    """dense_codes_linear (x, codes, scales, zeros, products_exact, group_size, n) -> x @ w.T in float32 for
    pack_codes' layout, or None where the CPU kernels cannot be built or the CPU lacks AVX2 with FMA and F16C or has
    AVX-512 (whose dense_linear sums otherwise)."""
    from kernels.cpu_ops import try_load

    return (
        torch.ops.llmmesh_dense.dense_codes_linear
        if try_load() is not None and torch.ops.llmmesh_dense.dense_codes_supported()
        else None
    )
