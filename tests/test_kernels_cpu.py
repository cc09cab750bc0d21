"""The C++ CPU kernels (kernels/cpu/paged_attention.cpp) against the torch references (kernels/reference.py).

The cpu backend end to end is in test_correctness.py, against Hugging Face on SmolLM2."""

import pytest
import torch

from kernels.cpu_attention import load
from kernels.reference import paged_attention_ref, reshape_and_cache_ref
from test_kernels_triton import MIXED, SHARED, make_batch

ops = load()
# (num_heads, num_kv_heads): MQA, GQA with groups of 3 (SmolLM2's), MHA.
HEADS = [(4, 1), (9, 3), (2, 2)]


def check_attention(requests, block_size, num_heads, num_kv_heads, head_dim, dtype, tol, share=None):
    batch = make_batch(requests, block_size, num_heads, num_kv_heads, head_dim, dtype, "cpu", share)
    scale = head_dim**-0.5
    out = ops.paged_attention(*batch, scale)
    ref = paged_attention_ref(*(t.float() if t.is_floating_point() else t for t in batch), scale)
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


def test_paged_attention_runs_on_every_thread_count():
    """The work split by cost must cover every item once, whatever the number of threads."""
    batch = make_batch(MIXED, 16, 9, 3, 64, torch.float32, "cpu", SHARED)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 3, 7):
            torch.set_num_threads(n)
            outs.append(ops.paged_attention(*batch, 0.125))
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
