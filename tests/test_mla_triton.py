"""The Triton backend's multi-head latent attention (kernels/mla_attention.py) and attention sinks (unified_attention)
against the torch references: mla_decode against mla_decode_ref, concat_and_cache_mla against write_latents, the
backend's forward_mla (absorbed decodes, up-projected prefill rows) and forward with sinks against the torch
backend's; "auto" picks it for DeepSeek and gpt-oss on CUDA; and, on a GPU, both families end to end against
Hugging Face.

Without a GPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py), on tiny shapes.
"""

import os

import families
import pytest
import torch
from test_deepseek import deepseek_v2
from test_gpt_oss import config as gpt_oss
from test_kernels_triton import MIXED, SHARED, backend_step, make_batch
from test_mla import RANK, ROPE, SCALE, paged_batch, random_layer

from conftest import assert_no_leaks, run_greedy
from engine.attention.mla import mla_kv_cache_shape, write_latents
from engine.attention.selector import get_attn_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.attention.triton_backend import TritonAttentionBackend
from kernels.mla_attention import concat_and_cache_mla, mla_decode
from kernels.reference import mla_decode_ref, paged_attention_ref
from kernels.unified_attention import unified_attention

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def decode_batch(seq_lens, block_size, num_heads, rank, rope, cache_dtype, gen):
    """Decode queries over a latent cache of scattered blocks; every entry no request owns (holes, past each
    sequence's end) is NaN, so reading one shows."""
    needed = [-(s // -block_size) for s in seq_lens]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros(len(seq_lens), max(needed) + 1, dtype=torch.int64)
    cache = torch.full((num_blocks, block_size, rank + rope), float("nan"))
    for r, (seq_len, n) in enumerate(zip(seq_lens, needed)):
        table[r, :n] = torch.tensor([pool.pop() for _ in range(n)])
        pos = torch.arange(seq_len)
        cache[table[r, pos // block_size], pos % block_size] = torch.randn(seq_len, rank + rope, generator=gen)
    query = torch.randn(len(seq_lens), num_heads, rank + rope, generator=gen)
    return query, cache.to(cache_dtype), torch.tensor(seq_lens), table


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "block_size, num_heads, rank, rope",
    [(16, 4, 32, 8), (1, 20, 24, 8), (8, 3, 16, 16)],
    ids=["mqa4", "two-head-blocks-odd-rank", "rope-as-wide"],
)
def test_mla_decode_float32(device, block_size, num_heads, rank, rope):
    """Contexts of 0 (a CUDA graph's padding row) to 70 entries, several tiles; 20 heads span two programs' heads."""
    gen = torch.Generator().manual_seed(0)
    query, cache, seq_lens, table = decode_batch(
        [37, 1, 0, 70, 16], block_size, num_heads, rank, rope, torch.float32, gen
    )
    out = torch.full((len(seq_lens), num_heads, rank), float("nan"), device=device)
    mla_decode(out, query.to(device), cache.to(device), seq_lens.to(device), table.to(device), rank, 0.3)
    ref = mla_decode_ref(query, cache, seq_lens, table, rank, 0.3)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2].cpu(), torch.zeros(num_heads, rank))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mla_decode_reads_a_cache_of_another_dtype(device, cache_dtype):
    gen = torch.Generator().manual_seed(1)
    query, cache, seq_lens, table = decode_batch([9, 40], 16, 4, 32, 8, cache_dtype, gen)
    out = torch.empty(2, 4, 32, device=device)
    mla_decode(out, query.to(device), cache.to(device), seq_lens.to(device), table.to(device), 32, 0.3)
    ref = mla_decode_ref(query, cache, seq_lens, table, 32, 0.3)  # reads the cache's values, as the kernel does
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_concat_and_cache_mla_equals_write_latents(device, cache_dtype):
    gen = torch.Generator().manual_seed(2)
    num_tokens, block_size = 10, 4
    # kv_c and k_pe as the model makes them: views into one projection's row, not contiguous.
    projected = torch.randn(num_tokens, RANK + ROPE, generator=gen).to(cache_dtype)
    kv_c, k_pe = projected[:, :RANK], projected[:, RANK:]
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    cache = torch.randn(mla_kv_cache_shape(6, block_size, RANK + ROPE), generator=gen).to(cache_dtype)
    expected = cache.clone()
    real = torch.ones(num_tokens, dtype=torch.bool)
    real[[3, 8]] = False  # padding tokens (slot -1) write nothing
    write_latents(kv_c[real], k_pe[real], expected, slots[real])
    ours = cache.to(device, copy=True)
    concat_and_cache_mla(kv_c.to(device), k_pe.to(device), ours, slots.masked_fill(~real, -1).to(device))
    assert torch.equal(ours.cpu(), expected) and not torch.equal(expected, cache)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_triton_backend_mla_equals_the_torch_backend(device, cache_dtype):
    """One step: decodes over contexts of 40, 17 and 1, a chunk of 5 tokens after 6 cached ones and a whole prompt
    of 7, over scattered blocks; the same outputs and the same cache as the torch backend's."""
    gen = torch.Generator().manual_seed(3)
    _, w_uk, w_uv = random_layer(gen)
    block_size = 8
    seq_lens, new_tokens = [40, 17, 1, 11, 7], [1, 1, 1, 5, 7]
    needed = [-(n // -block_size) for n in seq_lens]
    pool = torch.randperm(sum(needed) + 3, generator=gen).tolist()
    tables = [pool[sum(needed[:r]) : sum(needed[: r + 1])] for r in range(len(needed))]
    cache, step, metadata, *_ = paged_batch(gen, block_size, len(pool), seq_lens, new_tokens, tables, cache_dtype)
    outputs, caches = [], []
    for backend, dev in ((TorchAttentionBackend(block_size), "cpu"), (TritonAttentionBackend(block_size), device)):
        for field in ("slot_mapping", "query_start_loc", "seq_lens", "block_table"):
            setattr(metadata, field, getattr(metadata, field).to(dev))
        caches.append(cache.to(dev, copy=True))
        backend.prepare(metadata)
        out = backend.forward_mla(*(t.to(dev) for t in step), caches[-1], metadata, SCALE, w_uk.to(dev), w_uv.to(dev))
        outputs.append(out.cpu())
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(caches[0], caches[1].cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,cap", [(None, None), (16, None), (None, 2.0)])
def test_unified_attention_with_sinks(device, window, cap):
    """Sinks of both signs, large enough to take most of some heads' softmax, over MIXED (its padding requests get 0)."""
    query, k_cache, v_cache, qsl, seq_lens, table = make_batch(MIXED, 16, 6, 2, 16, torch.float32, device, SHARED)
    sinks = torch.tensor([-3.0, 0.0, 1.5, 4.0, -0.5, 2.5], device=device)
    out = torch.zeros_like(query)
    unified_attention(out, query, k_cache, v_cache, qsl, seq_lens, table, 0.25, window, cap, sinks)
    batch = (t.cpu() for t in (query, k_cache, v_cache, qsl, seq_lens, table))
    ref = paged_attention_ref(*batch, 0.25, window, cap, sinks.cpu())
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    without = paged_attention_ref(
        *(t.cpu() for t in (query, k_cache, v_cache, qsl, seq_lens, table)), 0.25, window, cap
    )
    assert not torch.allclose(ref, without, atol=1e-3)  # the sinks changed the output


@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_passes_sinks(device):
    sinks = torch.tensor([1.0, -2.0, 0.5, 3.0, 0.0, -1.0])
    ours, torch_out = backend_step(TritonAttentionBackend(16), 8, None, device, sinks)
    torch.testing.assert_close(ours, torch_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("needs", [{"mla"}, {"sinks", "sliding_window"}])
def test_auto_picks_the_triton_backend_for_mla_and_sinks_on_cuda(needs):
    assert isinstance(get_attn_backend("auto", 16, "cuda", frozenset(needs)), TritonAttentionBackend)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["deepseek-v2", "gpt-oss"])
def test_deepseek_and_gpt_oss_on_the_triton_backend_match_hf_on_cuda(tmp_path, family):
    """The backend auto picks on CUDA, in float32: greedy output equal to Hugging Face's with chunked prefills
    (absorbed decodes, up-projected chunks; gpt-oss's sinks beside its sliding windows) and a prefix-cache hit."""
    config = deepseek_v2() if family == "deepseek-v2" else gpt_oss()
    path, hf_model = families.save_family_model(tmp_path, config)
    engine = families.make_engine(path, device="cuda", dtype="float32", max_num_batched_tokens=16)
    assert engine.worker.attn_backend.name == "triton"
    first = families.prompts(config)
    shared = [first[2][:32] + first[0]]  # four full blocks of the 45-token prompt's
    outputs = run_greedy(engine, first, families.MAX_TOKENS) + run_greedy(engine, shared, families.MAX_TOKENS)
    assert engine.get_stats().prefix_cache_hits >= 32
    families.assert_matches_hf(hf_model, first + shared, outputs, f"{family} on triton")
    assert_no_leaks(engine)
