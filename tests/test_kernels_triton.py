"""The Triton kernels against the torch references (kernels/reference.py), and the triton backend end to end.

Without a GPU the kernels run under TRITON_INTERPRET=1 (set in conftest.py); the same cases run on CUDA
when there is one (marked gpu).
"""

import os

import pytest
import torch

from conftest import HFReference, assert_greedy_matches, assert_no_leaks, run_greedy
from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.config import EngineArgs
from engine.core import EngineCore
from kernels.reference import paged_attention_ref, reshape_and_cache_ref
from kernels.reshape_and_cache import reshape_and_cache
from kernels.unified_attention import unified_attention
from test_models import save_random_model

# Triton runs CPU tensors only under its interpreter, which conftest.py turns on when there is no GPU.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED, reason="TRITON_INTERPRET is off")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]
# (num_heads, num_kv_heads): MQA, GQA with groups of 3, MHA.
HEADS = [(4, 1), (6, 2), (2, 2)]

# (query tokens, seq_len) per request, in the engine's order (decodes first). It covers decodes, a whole
# prompt, a later prefill chunk, a prefix-cache hit, a request with no query rows, and the CUDA-graph
# runner's padding requests (seq_len 0, one query token). Requests 6 and 7 share their first blocks.
MIXED = [(1, 37), (1, 1), (1, 16), (1, 33), (5, 5), (0, 12), (7, 40), (19, 50), (1, 0), (1, 0)]
SHARED = (6, 7)


def make_batch(requests, block_size, num_heads, num_kv_heads, head_dim, dtype, device, share=None):
    """A batch over a shuffled block pool: blocks left over (holes) and past each sequence's end are NaN, so
    reading one shows. The two requests in `share` share their first blocks, as prefix-cache hits do."""
    gen = torch.Generator().manual_seed(0)
    blocks_needed = [-(seq_len // -block_size) for _, seq_len in requests]
    num_blocks = sum(blocks_needed) + 5
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.zeros(len(requests), max(blocks_needed) + 2, dtype=torch.int64)  # padded with 0
    for r, n in enumerate(blocks_needed):
        block_table[r, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int64)
    if share:
        a, b = share
        shared = min(blocks_needed[a], blocks_needed[b]) - 1
        block_table[b, :shared] = block_table[a, :shared]

    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for r, (_, seq_len) in enumerate(requests):  # real tokens where each sequence's tokens are
        pos = torch.arange(seq_len)
        blocks, offsets = block_table[r, pos // block_size], pos % block_size
        k_cache[:, blocks, offsets] = torch.randn(num_kv_heads, seq_len, head_dim, generator=gen)
        v_cache[:, blocks, offsets] = torch.randn(num_kv_heads, seq_len, head_dim, generator=gen)
    # One trailing row belongs to no request: it must stay untouched.
    num_tokens = sum(q for q, _ in requests) + 1
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    query_start_loc = torch.tensor([0] + [q for q, _ in requests]).cumsum(0)
    seq_lens = torch.tensor([s for _, s in requests])
    tensors = (query.to(dtype), k_cache.to(dtype), v_cache.to(dtype), query_start_loc, seq_lens, block_table)
    return tuple(t.to(device) for t in tensors)


# (sliding window, soft-cap) against MIXED's contexts of 0 to 50 keys: the query alone, windows smaller than most
# contexts and equal to some (16, 40), larger than all. The scores have about unit variance, so a cap of 2 bites.
WINDOW_CAPS = [(1, None), (16, None), (40, 2.0), (1000, None), (None, 2.0), (16, 2.0)]

# Decodes, a whole prompt, a chunk after its cached prefix and a long chunk, contexts many blocks past the window.
LONG = [(1, 300), (1, 37), (1, 16), (20, 200), (5, 5), (71, 150), (1, 0)]


def hide_outside_windows(batch, requests, window):
    """The batch with every key that no query of its request sees in a window of `window` turned NaN, and the block
    table's entries for the blocks wholly before the window pointed at a NaN placeholder block: a kernel that reads
    any of them shows it. No blocks may be shared (a request would hide another's keys)."""
    query, k_cache, v_cache, qsl, seq_lens, table = (t.clone() for t in batch)
    block_size = k_cache.shape[2]
    nan_block = torch.full_like(k_cache[:, :1], float("nan"))
    k_cache, v_cache = torch.cat([k_cache, nan_block], 1), torch.cat([v_cache, nan_block], 1)
    for r, (q_len, seq_len) in enumerate(requests):
        first = max(0, seq_len - q_len + 1 - window)  # the first key its first query sees
        partial = table[r, first // block_size]
        k_cache[:, partial, : first % block_size] = float("nan")
        v_cache[:, partial, : first % block_size] = float("nan")
        table[r, : first // block_size] = k_cache.shape[1] - 1
    return query, k_cache, v_cache, qsl, seq_lens, table


def backend_step(backend, window, cap, device, sinks=None):
    """One step of a mixed batch (decodes, a prompt, a chunk after its cached prefix) through backend.forward and
    through the torch backend's, with sinks [6] where given: (ours, torch's) outputs."""
    requests = [(1, 37), (1, 1), (1, 16), (5, 5), (7, 40), (19, 50)]
    query, k_cache, v_cache, qsl, seq_lens, table = make_batch(requests, 16, 6, 2, 16, torch.float32, device)
    # The torch backend reads whole blocks: no NaN past a sequence's end.
    k_cache, v_cache = k_cache.nan_to_num(0), v_cache.nan_to_num(0)
    n = int(qsl[-1])
    gen = torch.Generator().manual_seed(2)
    key, value = (torch.randn(n, 2, 16, generator=gen).to(device) for _ in range(2))
    pos = torch.cat([torch.arange(s - q, s) for q, s in requests])
    req = torch.cat([torch.full((q,), r) for r, (q, _) in enumerate(requests)])
    slots = (table.cpu()[req, pos // 16] * 16 + pos % 16).to(device)
    outs = []
    for attn in (backend, TorchAttentionBackend(16)):
        metadata = AttentionMetadata(n, slots, qsl, seq_lens, table, 3, qsl.tolist(), seq_lens.tolist())
        attn.prepare(metadata)
        caches = k_cache.clone(), v_cache.clone()
        head_sinks = None if sinks is None else sinks.to(device)
        outs.append(attn.forward(query[:n], key, value, caches, metadata, 0.25, window, cap, head_sinks))
    return outs


def check_attention(
    requests, block_size, num_heads, num_kv_heads, head_dim, dtype, device, tol, share=None, window=None, cap=None
):
    query, k_cache, v_cache, qsl, seq_lens, block_table = make_batch(
        requests, block_size, num_heads, num_kv_heads, head_dim, dtype, device, share
    )
    scale = head_dim**-0.5
    out = torch.zeros_like(query)
    unified_attention(out, query, k_cache, v_cache, qsl, seq_lens, block_table, scale, window, cap)
    batch = (t.cpu() for t in (query, k_cache, v_cache, qsl, seq_lens, block_table))
    ref = paged_attention_ref(*batch, scale, window, cap)
    # The reference is zero for padding requests and the row of no request, and NaN never passes.
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv")
@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_unified_attention_float32(device, heads, block_size):
    check_attention(MIXED, block_size, *heads, 16, torch.float32, device, tol=1e-5, share=SHARED)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unified_attention_half(device, dtype):
    # On the GPU the softmax weights go through the dot in bf16/fp16, so allow their rounding.
    check_attention(MIXED, 16, 6, 2, 16, dtype, device, tol=2e-2, share=SHARED)


@pytest.mark.parametrize("device", DEVICES)
def test_unified_attention_odd_head_dim_and_many_queries(device):
    # head_dim 24 pads to 32; a 40-token chunk spans several query blocks of one request.
    check_attention([(1, 9), (40, 70), (3, 3)], 8, 4, 2, 24, torch.float32, device, tol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,cap", WINDOW_CAPS)
def test_unified_attention_sliding_window_and_soft_cap(device, window, cap):
    check_attention(MIXED, 16, 6, 2, 16, torch.float32, device, tol=1e-5, share=SHARED, window=window, cap=cap)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [1, 24, 32])
def test_unified_attention_reads_nothing_before_the_window(device, window):
    """Keys before every window of a request are NaN and its blocks wholly before them a placeholder: the output is
    the same, finite. MQA; block size 16, so a window of 24 starts inside a block and one of 32 at a block's start."""
    batch = make_batch(LONG, 16, 4, 1, 16, torch.float32, device)
    hidden = hide_outside_windows(batch, LONG, window)
    outs = []
    for b in (batch, hidden):
        outs.append(torch.zeros_like(b[0]))
        unified_attention(outs[-1], *b, 0.25, window, 2.0)
    assert torch.equal(outs[0], outs[1])
    ref = paged_attention_ref(*(t.cpu() for t in batch), 0.25, window, 2.0)
    torch.testing.assert_close(outs[1].cpu(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,cap", [(8, 2.0), (20, None)])
def test_triton_backend_passes_window_and_cap(device, window, cap):
    from engine.attention.triton_backend import TritonAttentionBackend

    ours, torch_out = backend_step(TritonAttentionBackend(16), window, cap, device)
    torch.testing.assert_close(ours, torch_out, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_unified_attention_replays_in_a_cuda_graph():
    """Captured over padding contents, as the graph runner captures; replayed after the batch's tensors are
    refilled in place: the launch must not have baked in anything it read at capture."""
    requests = [(1, 37), (1, 1), (1, 16), (1, 0)]
    batch = make_batch(requests, 16, 6, 2, 16, torch.float32, "cuda")
    query, k_cache, v_cache, qsl, seq_lens, block_table = batch
    real = [t.clone() for t in (seq_lens, block_table)]
    seq_lens.zero_()
    block_table.zero_()
    out = torch.zeros_like(query)
    unified_attention(out, *batch, 0.25)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        unified_attention(out, *batch, 0.25)
    seq_lens.copy_(real[0])
    block_table.copy_(real[1])
    graph.replay()
    ref = paged_attention_ref(*(t.cpu() for t in batch), 0.25)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16])
def test_reshape_and_cache(device, dtype, block_size):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, num_blocks = 12, 3, 16, 40 // block_size + 2
    # key/value as the model passes them: views into one fused qkv row, not contiguous.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=gen).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_ref(key, value, k_ref, v_ref, slots)
    k_out, v_out = k_cache.to(device, copy=True), v_cache.to(device, copy=True)
    reshape_and_cache(key.to(device), value.to(device), k_out, v_out, slots.to(device))
    assert torch.equal(k_out.cpu(), k_ref) and torch.equal(v_out.cpu(), v_ref)
    assert not torch.equal(k_ref, k_cache)  # it wrote something


@pytest.mark.parametrize("device", DEVICES)
def test_triton_backend_matches_hf_and_torch(tmp_path, device):
    """A tiny Llama through the engine: greedy tokens identical to Hugging Face and to the torch backend,
    with chunked prefills (24-token budget) and a prefix-cache hit (the last prompt repeats the first's start)."""
    path, hf_model = save_random_model(tmp_path, "llama3-rope-untied")
    reference = HFReference(hf_model)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (30, 5, 13)]
    prompts.append(prompts[0][:24] + prompts[2])

    def run(backend):
        engine = EngineCore(
            EngineArgs(
                model=str(path),
                device=device,
                dtype="float32",
                kv_cache_memory="8MiB",
                block_size=8,
                max_num_batched_tokens=24,
                attention_backend=backend,
            )
        )
        assert engine.worker.attn_backend.name == backend
        first = run_greedy(engine, prompts[:3], 6)
        hits = engine.kv_cache_manager.prefix_cache_stats.hits
        outputs = first + run_greedy(engine, prompts[3:], 6)
        assert engine.kv_cache_manager.prefix_cache_stats.hits >= hits + 24  # the repeated start was a hit
        assert_no_leaks(engine)
        return outputs

    triton_out = run("triton")
    assert triton_out == run("torch")
    for i, (prompt, ours) in enumerate(zip(prompts, triton_out)):
        ref_tokens, ref_logits = reference.greedy(prompt, 6)
        assert assert_greedy_matches(ours, ref_tokens, ref_logits, f"prompt {i}")
