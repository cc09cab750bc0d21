"""kernels/cpu/dense.cpp's dense_linear: bfloat16 and float32 products of a decode step's few rows, read from
oneDNN's packed weight (kernels/dense.py), against torch's float32 or float64 product, and in the engine against
oneDNN alone."""

import pytest
import torch

from engine.llm import LLM
from engine.models import quantization
from engine.request import SamplingParams
from kernels.dense import dense_codes_kernel, dense_kernel, pack_codes, pack_dense, packed_view
from kernels.quant import dequantize, quantize_int4, quantize_int8

bfloat16 = pytest.mark.skipif(dense_kernel() is None, reason="dense_linear's bfloat16 needs AVX512-BF16")
float32 = pytest.mark.skipif(dense_kernel(torch.float32) is None, reason="dense_linear's float32 needs AVX-512 or AVX2")
codes = pytest.mark.skipif(dense_codes_kernel() is None, reason="dense_codes_linear needs AVX2 with FMA, no AVX-512")


def _packed(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return packed, packed_view(packed, w)


@bfloat16
def test_packed_view_reads_onednns_packed_weight_in_place():
    """oneDNN packs in tiles of 32 columns on a CPU with AMX, of 64 on one without: the view is whichever it is."""
    w = torch.randn(100, 70).bfloat16()
    packed, view = _packed(w)
    assert view is not None and view.data_ptr() == torch.ops.mkldnn.data_ptr(packed)
    tile = view.shape[2]
    # 100 -> 128 columns, 70 -> 96 inputs
    assert torch.equal(view, pack_dense(w, tile)) and view.shape == (128 // tile, 48, tile, 2)
    assert packed_view(packed, torch.randn(100, 40).bfloat16()) is None  # the bytes of another shape: refused


# K: a multiple of 32, one that is not, an odd one; N: whole tiles of 32 or 64 and a part-filled last tile.
SHAPES = [(96, 64), (100, 70), (33, 31), (5, 3), (64, 1536)]


@bfloat16
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tile", [32, 64])
def test_dense_linear_matches_float32_within_bfloat16_rounding(n, k, bias, tile):
    """Both of oneDNN's layouts, whichever this CPU's oneDNN makes (the kernel reads any tensor laid out so)."""
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen).bfloat16()
    b = torch.randn(n, generator=gen).bfloat16() if bias else None
    view = pack_dense(w, tile)
    for rows in range(1, quantization.DENSE_MAX_ROWS[torch.bfloat16, tile] + 2):  # every row count it runs, one more
        x = torch.randn(rows, k, generator=gen).bfloat16()
        want = x.float() @ w.float().T + (b.float() if bias else 0)
        got = dense_kernel()(x, view, n, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
        # Rounding to bfloat16 is within one step of the float32 value (8 significant bits), plus float32's own
        # error in a sum of another order (which matters only where terms cancel to near zero).
        step = 2.0 ** (torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
        allowed = step + 1e-5 * (x.float().abs() @ w.float().abs().T)
        worst = ((got.float() - want).abs() / allowed).max().item()
        assert worst <= 1.0, f"{rows} rows of [{n}, {k}], bias {bias}: {worst:.2f} of the rounding allowed"


@bfloat16
def test_dense_linear_refuses_what_it_cannot_read():
    w = torch.randn(64, 64).bfloat16()
    view = pack_dense(w, 32)
    with pytest.raises(RuntimeError, match="float32 layout"):  # float32 x on a bfloat16 weight
        dense_kernel()(torch.randn(1, 64), view, 64, None)
    with pytest.raises(RuntimeError, match="bfloat16 or float32"):
        dense_kernel()(torch.randn(1, 64).half(), view, 64, None)
    with pytest.raises(RuntimeError, match="last tile"):
        dense_kernel()(torch.randn(1, 64).bfloat16(), view, 65, None)
    with pytest.raises(RuntimeError, match="K"):
        dense_kernel()(torch.randn(1, 128).bfloat16(), view, 64, None)
    with pytest.raises(RuntimeError, match="32 or 64"):  # tiles of another width
        dense_kernel()(torch.randn(1, 64).bfloat16(), pack_dense(w, 16), 64, None)


@float32
def test_packed_view_reads_onednns_packed_float32_weight_in_place():
    w = torch.randn(100, 70)
    packed, view = _packed(w)
    assert view is not None and view.data_ptr() == torch.ops.mkldnn.data_ptr(packed)
    assert torch.equal(view, pack_dense(w)) and view.shape == (2, 80, 64)  # 100 -> 128 columns, 70 -> 80 inputs
    assert packed_view(packed, torch.randn(100, 40)) is None


@float32
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_dense_linear_float32_matches_float64(n, k, bias):
    gen = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    _, view = _packed(w)
    for rows in range(1, quantization.DENSE_MAX_ROWS[torch.float32, 64] + 2):  # every row count it runs, and one more
        x = torch.randn(rows, k, generator=gen)
        want = x.double() @ w.double().T + (b.double() if bias else 0)
        got = dense_kernel(torch.float32)(x, view, n, b)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        # float32's error in a sum of k products, each term rounded once (about k * 2**-24 of the terms' size).
        allowed = (k + 2) * 2.0**-24 * (x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0))
        worst = ((got.double() - want).abs() / allowed).max().item()
        assert worst <= 1.0, f"{rows} rows of [{n}, {k}], bias {bias}: {worst:.2f} of the error allowed"


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=bfloat16), pytest.param("float32", marks=float32)])
def test_engine_gives_onednns_greedy_tokens(tiny_llama_dir, monkeypatch, dtype):
    llm = LLM(str(tiny_llama_dir), dtype=dtype, kv_cache_memory="4MiB")
    layers = [m for m in llm.engine.worker.model.modules() if getattr(m, "packed_dense", None) is not None]
    assert len(layers) == 2 * 4 + 1  # qkv, o, gate_up, down a layer, and the tied lm_head
    prompts = [{"prompt_token_ids": list(range(3 + i, 40 + 7 * i))} for i in range(4)]
    params = [SamplingParams(temperature=0.0, max_tokens=12 + 4 * i, ignore_eos=True) for i in range(4)]

    def greedy():  # four requests: steps of 4, 3, 2 and 1 rows as they finish
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    with_kernel = greedy()
    monkeypatch.setattr(quantization, "DENSE_MAX_ROWS", {})
    assert with_kernel == greedy()


@float32
@pytest.mark.parametrize("n, k", [(960, 576), (200, 1536), (128, 2100)])
@pytest.mark.parametrize("bias", [False, True])
def test_invariant_float32_layer_gives_each_row_its_bits_alone(n, k, bias):
    """With batch invariance on, a float32 layer hands steps past dense_linear's rows to oneDNN only where the load
    check found oneDNN summing as dense_linear does (so on an AVX2 CPU: chains of 1,024 inputs, K > 1,024 included);
    either way a row among hundreds is the row alone, bit for bit."""
    from engine.models.linear import Linear, process_weights_after_loading

    gen = torch.Generator().manual_seed(k)
    layer = Linear(k, n, bias=bias)
    layer.weight.data.copy_(torch.randn(n, k, generator=gen) / 24)
    if bias:
        layer.bias.data.normal_(generator=gen)
    process_weights_after_loading(layer, torch.float32, batch_invariant=True)
    assert layer.packed_dense is not None
    if torch.backends.cpu.get_cpu_capability() == "AVX2":
        assert not layer.dense_every_m  # oneDNN's AVX2 kernel sums as dense_linear's AVX2 form
    x = torch.randn(300, k, generator=gen)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for rows in (7, 25, 47, 101, 300):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"


# 4-bit codes in groups of 32 with float16 scales (GGUF's Q4_1) and with float32 ones (Q4_K's, a float16 times a 6-bit
# integer), 8-bit in groups of 32 with float16 scales (Q8_0), 16, 48 (straddling a chain of 1,024 inputs) and one a
# row; K under and over 1,024; N whole tiles and a part-filled last one. Each case's layout: the codes' and scales'
# dtypes, and whether every code times its scale is exact in float32 (one FMA forms a weight).
CODE_CASES = {
    ("int4/32", 960, 576): (torch.uint8, torch.float16, True),
    ("int4/32", 100, 2080): (torch.uint8, torch.float16, True),
    ("q4k/32", 200, 1088): (torch.uint8, torch.float32, True),
    ("q8_0/32", 200, 1536): (torch.int8, torch.float16, True),
    ("int8/16", 576, 1536): (torch.int8, torch.float32, False),
    ("int8/48", 64, 1536): (torch.int8, torch.float32, False),
    ("int8/row", 200, 1536): (torch.int8, torch.float32, False),
}


def _codes(kind: str, n: int, k: int, gen: torch.Generator):
    w = torch.randn(n, k, generator=gen)
    bits, group = kind.split("/")
    group_size = k if group == "row" else int(group)
    q, scales, zeros = (quantize_int4 if bits in ("int4", "q4k") else quantize_int8)(w, group_size)
    if bits == "q4k":  # a float16 times a 6-bit sub-block scale: exact in float32, mostly not a float16
        scales = scales * torch.randint(1, 64, scales.shape, generator=gen).float()
    elif bits == "q8_0":
        scales = scales.half().float()
    return q, scales, zeros


@codes
@pytest.mark.parametrize("kind, n, k", CODE_CASES)
def test_dense_codes_linear_gives_the_dequantized_weights_bits(kind, n, k):
    """Each weight formed in registers as dequantize() forms it, each column summed as dense_linear sums it: the same
    bits as dense_linear on the dequantized weight, at every row count, in each layout of the codes."""
    gen = torch.Generator().manual_seed(n + k)
    q, scales, zeros = _codes(kind, n, k, gen)
    _, view = _packed(dequantize(q, scales, zeros))
    packed = pack_codes(q, scales, zeros)
    codes_dtype, scales_dtype, exact = CODE_CASES[kind, n, k]
    assert (packed[0].dtype, packed[1].dtype, packed[2].dtype, packed[3]) == (
        codes_dtype,
        scales_dtype,
        scales_dtype,
        exact,
    )
    assert packed[0].shape == (-(-n // 64), k, 32 if codes_dtype == torch.uint8 else 64)
    for rows in (1, 2, 3, 4, 7):
        x = torch.randn(rows, k, generator=gen)
        got = torch.ops.llmmesh_dense.dense_codes_linear(x, *packed, k // scales.shape[1], n)
        assert torch.equal(got, torch.ops.llmmesh_dense.dense_linear(x, view, n, None)), f"{rows} rows"


@codes
def test_dense_codes_linear_refuses_a_layout_it_does_not_read():
    gen = torch.Generator().manual_seed(3)
    q, scales, zeros = _codes("int4/32", 64, 64, gen)
    codes, halves, zero_halves, exact = pack_codes(q, scales, zeros)
    x = torch.randn(1, 64, generator=gen)
    op = torch.ops.llmmesh_dense.dense_codes_linear
    with pytest.raises(RuntimeError, match="both float32 or both float16"):
        op(x, codes, halves, zero_halves.float(), exact, 32, 64)
    with pytest.raises(RuntimeError, match=r"uint8 \[tiles, K, 32\]"):
        op(x, codes.view(torch.int8), halves, zero_halves, exact, 32, 64)  # 32 int8 codes an input
    with pytest.raises(RuntimeError, match="K > 0"):
        op(x[:, :0], codes[:, :0], halves[:, :0], zero_halves[:, :0], exact, 32, 64)


@codes
@pytest.mark.parametrize("bias", [False, True])
def test_float32_codes_run_few_rows_on_their_kernel_and_each_row_keeps_its_bits(bias):
    """A float32 layer of 4-bit codes runs steps of up to CODES_MAX_ROWS rows on the codes (a quarter of the bytes)
    and more on the dequantized weight, with batch invariance on: a row among hundreds is the row alone, bit for bit."""
    from torch import nn

    from engine.models.linear import Linear, process_weights_after_loading

    gen = torch.Generator().manual_seed(7)
    layer = Linear(576, 960, bias=bias, quant_method=quantization.Int4LinearMethod())
    for name, value in zip(("qweight", "scales", "zeros"), _codes("int4/32", 960, 576, gen)):
        setattr(layer, name, nn.Parameter(value, requires_grad=False))
    if bias:
        layer.bias.data.normal_(generator=gen)
    process_weights_after_loading(layer, torch.float32, batch_invariant=True)
    assert layer.kernel is not None and layer.kernel_max_rows == quantization.CODES_MAX_ROWS
    x = torch.randn(300, 576, generator=gen)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, quantization.CODES_MAX_ROWS, quantization.CODES_MAX_ROWS + 1, 47, 300):
        assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"
