"""The C++ CPU kernels (kernels/cpu/) against their torch references: paged attention against
kernels/reference.py, the norm, RoPE and SiLU-and-mul layers against the torch layers of engine/models/llama.py.

The cpu backend and the layers end to end are in test_correctness.py, against Hugging Face on SmolLM2."""

import pytest
import torch
from test_kernels_triton import LONG, MIXED, SHARED, backend_step, hide_outside_windows, make_batch

from engine.models.layers import RMSNorm, apply_rotary
from kernels.cpu_ops import load
from kernels.reference import paged_attention_ref, reshape_and_cache_ref

ops = load()
# (num_heads, num_kv_heads): MQA, GQA with groups of 3 (SmolLM2's), MHA.
HEADS = [(4, 1), (9, 3), (2, 2)]


def check_attention(
    requests, block_size, num_heads, num_kv_heads, head_dim, dtype, tol, share=None, window=None, cap=None
):
    batch = make_batch(requests, block_size, num_heads, num_kv_heads, head_dim, dtype, "cpu", share)
    scale = head_dim**-0.5
    out = ops.paged_attention(*batch, scale, window, cap)
    ref = paged_attention_ref(*(t.float() if t.is_floating_point() else t for t in batch), scale, window, cap)
    # The reference is zero for padding requests and the row of no request, and NaN (holes) never passes.
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_paged_attention_float32(heads, block_size):
    # Decodes, a whole prompt, a later chunk, a prefix hit on shared blocks, an empty request, padding.
    check_attention(MIXED, block_size, *heads, 64, torch.float32, tol=1e-5, share=SHARED)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_half(dtype):
    # Inputs are rounded alike for both; the kernel accumulates in float32 and rounds the output once.
    check_attention(MIXED, 16, 9, 3, 64, dtype, tol=1e-2, share=SHARED)


def test_paged_attention_odd_head_dim_and_long_chunk():
    # head_dim 24 is not a multiple of the vector width; a 300-token chunk spans many blocks.
    check_attention([(1, 9), (300, 333), (3, 3)], 8, 4, 2, 24, torch.float32, tol=1e-5)


# Batches of fewer than 8 items, split by key range and merged: one request's KV heads over a long prefix (SmolLM2's
# 16 rows after a reload), a decode alone, MQA's one KV head, a chunk in two tiles, two requests of which one is short.
FEW_ITEMS = [
    ([(16, 2064)], (9, 3)),
    ([(1, 1000)], (9, 3)),
    ([(1, 600)], (4, 1)),
    ([(100, 700)], (4, 1)),
    ([(3, 3000), (1, 40)], (2, 2)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("requests,heads", FEW_ITEMS)
def test_paged_attention_splits_few_items_by_key_range(requests, heads, dtype):
    check_attention(requests, 16, *heads, 64, dtype, tol=1e-5 if dtype == torch.float32 else 1e-2)


# MIXED's contexts are 0 to 50 keys: windows of the query alone, smaller than most contexts and equal to some (16,
# 40), larger than all. The scores have about unit variance, so a cap of 2 bites.
@pytest.mark.parametrize("cap", [None, 2.0])
@pytest.mark.parametrize("window", [1, 16, 40, 1000])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_attention_sliding_window_and_soft_cap(block_size, heads, window, cap):
    check_attention(MIXED, block_size, *heads, 64, torch.float32, tol=1e-5, share=SHARED, window=window, cap=cap)


def test_paged_attention_soft_cap_alone_in_half():
    check_attention(MIXED, 16, 9, 3, 64, torch.bfloat16, tol=1e-2, share=SHARED, cap=2.0)


# Few items split by key range within the window: a reload's 16 rows, decodes (a part of 2, a window that leaves one
# part), a chunk in two tiles whose rows' windows start apart, two requests of which one is shorter than the window.
@pytest.mark.parametrize(
    "requests,heads,window,cap",
    [
        ([(16, 2064)], (9, 3), 1000, None),
        ([(1, 1000)], (9, 3), 600, 2.0),
        ([(1, 600)], (4, 1), 300, None),
        ([(100, 700)], (4, 1), 300, 2.0),
        ([(3, 3000), (1, 40)], (2, 2), 1024, None),
    ],
)
def test_paged_attention_splits_the_window_by_key_range(requests, heads, window, cap):
    check_attention(requests, 16, *heads, 64, torch.float32, tol=1e-5, window=window, cap=cap)


# Block size 16: windows of the query alone, starting inside a block (24) and at a block's start (32); a decode and a
# chunk alone, each split by key range within its window.
@pytest.mark.parametrize(
    "requests,heads,window",
    [
        (LONG, (9, 3), 1),
        (LONG, (9, 3), 24),
        (LONG, (9, 3), 32),
        ([(1, 5000)], (4, 1), 1000),
        ([(40, 3000)], (4, 1), 700),
    ],
)
def test_paged_attention_reads_nothing_before_the_window(requests, heads, window):
    """Keys before every window of a request are NaN and its blocks wholly before them a placeholder: the output is
    the same, finite."""
    batch = make_batch(requests, 16, *heads, 64, torch.float32, "cpu")
    out = ops.paged_attention(*batch, 0.125, window, 2.0)
    hidden = ops.paged_attention(*hide_outside_windows(batch, requests, window), 0.125, window, 2.0)
    assert torch.equal(hidden, out)
    torch.testing.assert_close(out, paged_attention_ref(*batch, 0.125, window, 2.0), atol=1e-5, rtol=1e-5)


# Sinks large enough to take a visible share of 3000 keys' softmax: decodes, chunks, tiles, a window, a soft cap, and few
# items split by key range (their partial sums merged).
@pytest.mark.parametrize(
    "requests,heads,window,cap",
    [
        (MIXED, (9, 3), None, None),
        (LONG, (4, 1), 24, 2.0),
        ([(1, 3000)], (4, 1), None, None),
        ([(40, 3000)], (2, 2), 700, None),
    ],
)
def test_paged_attention_sinks(requests, heads, window, cap):
    batch = make_batch(requests, 16, *heads, 64, torch.float32, "cpu", SHARED if requests is MIXED else None)
    sinks = torch.randn(heads[0], generator=torch.Generator().manual_seed(2)) * 2 + 6
    out = ops.paged_attention(*batch, 0.125, window, cap, sinks)
    ref = paged_attention_ref(*batch, 0.125, window, cap, sinks)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, paged_attention_ref(*batch, 0.125, window, cap), rtol=0.01, atol=0)


@pytest.mark.parametrize("window,cap", [(8, 2.0), (20, None)])
def test_cpu_backend_passes_window_and_cap(window, cap):
    from engine.attention.cpu_backend import CpuAttentionBackend

    ours, torch_out = backend_step(CpuAttentionBackend(16), window, cap, "cpu")
    torch.testing.assert_close(ours, torch_out, atol=1e-5, rtol=1e-5)


def test_paged_attention_refuses_a_window_or_cap_of_zero():
    batch = make_batch(MIXED, 16, 9, 3, 64, torch.float32, "cpu", SHARED)
    for window, cap in ((0, None), (None, 0.0)):
        with pytest.raises(RuntimeError, match="must be positive"):
            ops.paged_attention(*batch, 0.125, window, cap)


@pytest.mark.parametrize("window,cap", [(None, None), (700, 2.0)])
def test_paged_attention_runs_on_every_thread_count(window, cap):
    """The work split by cost must cover every item once, whatever the number of threads, and a batch split by key
    range gives the same answer on any number of threads."""
    threads = torch.get_num_threads()
    for batch in (
        make_batch(MIXED, 16, 9, 3, 64, torch.float32, "cpu", SHARED),
        make_batch([(16, 2064)], 16, 9, 3, 64, torch.float32, "cpu"),
    ):
        try:
            outs = []
            for n in (1, 3, 7):
                torch.set_num_threads(n)
                outs.append(ops.paged_attention(*batch, 0.125, window, cap))
        finally:
            torch.set_num_threads(threads)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_reshape_and_cache(dtype, block_size):
    _, k_cache, v_cache, *_ = make_batch(MIXED, block_size, 9, 3, 64, dtype, "cpu", SHARED)
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(12, 2, 3, 64, generator=gen).to(dtype)  # key and value interleaved: strided views
    slots = torch.randperm(k_cache.shape[1] * block_size, generator=gen)[:12]
    slots[[2, 7]] = -1  # padding tokens
    expected = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(kv[:, 0], kv[:, 1], *expected, slots)
    ops.reshape_and_cache(kv[:, 0], kv[:, 1], k_cache, v_cache, slots)
    for got, want in zip((k_cache, v_cache), expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0, equal_nan=True)


# Float32 differs from the torch layers by float rounding only (sum order, fused multiply-adds); the
# half types by one rounding of the output.
LAYER_TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", list(LAYER_TOL))
def test_rms_norm(dtype):
    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=gen) + 0.5
    norm = norm.to(dtype)
    x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
    want = norm(x)
    norm.ops = ops
    got = norm(x)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=LAYER_TOL[dtype], rtol=LAYER_TOL[dtype])


@pytest.mark.parametrize("dtype", list(LAYER_TOL))
def test_rotary_embedding_in_place_on_strided_q_and_k(dtype):
    """q and k are views of a fused qkv output, as in Attention.forward; v must be left alone."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, tokens = 9, 3, 64, 21
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)
    angles = torch.rand(tokens, dim, generator=gen) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    want_q, want_k = apply_rotary(q, k, cos, sin)
    v_before = v.clone()
    ops.rotary_embedding(q, k, cos, sin)
    torch.testing.assert_close(q, want_q, atol=LAYER_TOL[dtype], rtol=LAYER_TOL[dtype])
    torch.testing.assert_close(k, want_k, atol=LAYER_TOL[dtype], rtol=LAYER_TOL[dtype])
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", list(LAYER_TOL))
def test_silu_and_mul(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(19, 2 * 96, generator=gen) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = ops.silu_and_mul(x)
    assert got.shape == (19, 96) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=LAYER_TOL[dtype], rtol=LAYER_TOL[dtype])


def test_layers_take_no_rows():
    # A step can have no tokens for a layer (the profiling pass, an empty batch): shapes, not crashes.
    assert ops.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-6).shape == (0, 8)
    assert ops.silu_and_mul(torch.empty(0, 8)).shape == (0, 4)
    q, k = torch.empty(0, 2, 8), torch.empty(0, 1, 8)
    ops.rotary_embedding(q, k, torch.empty(0, 8), torch.empty(0, 8))


def test_layer_kernels_refuse_bad_shapes():
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="2 \\* d"):
        ops.silu_and_mul(torch.ones(2, 7))
    with pytest.raises(RuntimeError, match="cos and sin"):
        ops.rotary_embedding(torch.ones(3, 2, 8), torch.ones(3, 1, 8), torch.ones(2, 8), torch.ones(2, 8))
