"""Multi-head latent attention (engine/attention/mla.py) on random inputs: the absorbed form (decode) and the
up-projected form (prefill) equal each other and a naive dense MLA that makes every head's K and V, also through the
torch backend's paged latent cache with decodes, a later prefill chunk and a whole prompt in one step; and the KV
cache spec of an MLA model is one latent vector per token and layer."""

import pytest
import torch
from test_cuda_graphs import tiny_config

from engine.attention.backend import AttentionMetadata
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.attention.mla import absorbed_attention, mla_kv_cache_shape, up_projected_attention, write_latents
from engine.attention.selector import get_attn_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kv.kv_cache_spec import MLAAttentionSpec, kv_cache_groups

HEADS, NOPE, ROPE, RANK, V_DIM = 4, 16, 8, 32, 12
SCALE = (NOPE + ROPE) ** -0.5


def random_layer(gen):
    """The up-projection (kv_b_proj's weight, [H * (nope + v), rank] as the checkpoint stores it) and its W_UK,
    W_UV parts."""
    kv_b = torch.randn(HEADS * (NOPE + V_DIM), RANK, generator=gen) * RANK**-0.5
    w_uk, w_uv = kv_b.view(HEADS, NOPE + V_DIM, RANK).split([NOPE, V_DIM], dim=1)
    return kv_b, w_uk, w_uv


def random_tokens(gen, n):
    q_nope, q_pe = torch.randn(n, HEADS, NOPE, generator=gen), torch.randn(n, HEADS, ROPE, generator=gen)
    return q_nope, q_pe, torch.randn(n, RANK, generator=gen), torch.randn(n, ROPE, generator=gen)


def dense_mla(q_nope, q_pe, kv_c, k_pe, kv_b):
    """Causal MLA as Hugging Face's DeepSeek-V2 computes it: kv_b_proj makes every head's K (nope part) and V from
    the latents, the rotary key is repeated over the heads, eager attention with a float32 softmax."""
    n = kv_c.shape[0]
    kv = (kv_c @ kv_b.T).view(n, HEADS, NOPE + V_DIM)
    k_nope, v = kv.split([NOPE, V_DIM], dim=-1)
    k = torch.cat([k_nope, k_pe[:, None].expand(n, HEADS, ROPE)], dim=-1)
    q = torch.cat([q_nope, q_pe], dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) * SCALE
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("hts,shv->thv", scores.softmax(-1), v)


def test_absorbed_and_up_projected_forms_equal_dense_mla():
    gen = torch.Generator().manual_seed(0)
    kv_b, w_uk, w_uv = random_layer(gen)
    n = 23
    q_nope, q_pe, kv_c, k_pe = random_tokens(gen, n)
    latents = torch.cat([kv_c, k_pe], dim=-1)
    dense = dense_mla(q_nope, q_pe, kv_c, k_pe, kv_b)

    up = up_projected_attention(q_nope, q_pe, latents, w_uk, w_uv, SCALE)
    torch.testing.assert_close(up, dense, atol=1e-5, rtol=1e-5)

    # Each token as a decode step over its own context: one row per token, the later keys masked off.
    mask = torch.ones(n, n, dtype=torch.bool).tril()[:, None, :]
    absorbed = absorbed_attention(q_nope, q_pe, latents.expand(n, n, -1), w_uk, w_uv, SCALE, mask)
    torch.testing.assert_close(absorbed, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(absorbed, up, atol=1e-5, rtol=1e-5)
    # The attention really depends on the latents' up-projection: another W_UV gives another output.
    assert not torch.allclose(up_projected_attention(q_nope, q_pe, latents, w_uk, -w_uv, SCALE), up)


def paged_batch(gen, block_size, num_blocks, seq_lens, new_tokens, tables, cache_dtype=torch.float32):
    """One step's batch over a paged latent cache whose earlier steps cached each request's first seq_len - new
    tokens: (cache, the step's q_nope, q_pe, kv_c, k_pe, metadata, each request's whole sequence, row starts).
    Decodes (new == 1) come first."""
    cache = torch.zeros(mla_kv_cache_shape(num_blocks, block_size, RANK + ROPE), dtype=cache_dtype)
    sequences = [random_tokens(gen, n) for n in seq_lens]

    def slots(r, positions):
        return torch.tensor(
            [tables[r][p // block_size] * block_size + p % block_size for p in positions], dtype=torch.long
        )

    for r, (seq_len, new) in enumerate(zip(seq_lens, new_tokens)):  # the context earlier steps cached
        _, _, kv_c, k_pe = sequences[r]
        write_latents(kv_c[: seq_len - new], k_pe[: seq_len - new], cache, slots(r, range(seq_len - new)))

    step = [tuple(t[seq_len - new :] for t in seq) for seq, seq_len, new in zip(sequences, seq_lens, new_tokens)]
    q_nope, q_pe, kv_c, k_pe = (torch.cat(parts) for parts in zip(*step))
    starts = [0]
    for new in new_tokens:
        starts.append(starts[-1] + new)
    block_table = torch.zeros(len(tables), max(map(len, tables)), dtype=torch.long)
    for r, table in enumerate(tables):
        block_table[r, : len(table)] = torch.tensor(table)
    metadata = AttentionMetadata(
        num_actual_tokens=starts[-1],
        slot_mapping=torch.cat([slots(r, range(s - n, s)) for r, (s, n) in enumerate(zip(seq_lens, new_tokens))]),
        query_start_loc=torch.tensor(starts),
        seq_lens=torch.tensor(seq_lens),
        block_table=block_table,
        num_decodes=new_tokens.count(1),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    return cache, (q_nope, q_pe, kv_c, k_pe), metadata, sequences, starts, slots


def test_paged_latent_cache_batch_equals_dense_mla():
    """One step of the torch backend over a paged cache: two decodes (contexts of 13 and 3), a chunk of 5 tokens
    after 6 cached ones, and a whole prompt of 7, each token's output that of dense MLA over its sequence."""
    gen = torch.Generator().manual_seed(1)
    kv_b, w_uk, w_uv = random_layer(gen)
    seq_lens, new_tokens = [13, 3, 11, 7], [1, 1, 5, 7]
    # Each request's blocks, scattered over the pool.
    tables = [[5, 2, 9, 14], [7], [0, 11, 3], [12, 6]]
    cache, step, metadata, sequences, starts, slots = paged_batch(gen, 4, 16, seq_lens, new_tokens, tables)
    q_nope, q_pe, kv_c, k_pe = step
    backend = TorchAttentionBackend(4)
    backend.prepare(metadata)
    out = backend.forward_mla(q_nope, q_pe, kv_c, k_pe, cache, metadata, SCALE, w_uk, w_uv)

    for r, (seq, seq_len, new) in enumerate(zip(sequences, seq_lens, new_tokens)):
        expected = dense_mla(*seq, kv_b)[seq_len - new :]
        torch.testing.assert_close(out[starts[r] : starts[r + 1]], expected, atol=1e-5, rtol=1e-5)
        # Each token's latent and rotary key landed in its slot.
        stored = cache.view(-1, RANK + ROPE)[slots(r, range(seq_len))]
        torch.testing.assert_close(stored, torch.cat(seq[2:], dim=-1))


@pytest.mark.parametrize(
    "dtype, cache_dtype, tolerance",
    [
        (torch.float32, torch.float32, 1e-5),
        (torch.float32, torch.bfloat16, 1e-5),
        (torch.float32, torch.float8_e4m3fn, 1e-5),
        (torch.bfloat16, torch.bfloat16, 2e-2),  # the torch backend attends in bfloat16, the kernel in float32
    ],
)
def test_cpu_backend_mla_equals_the_torch_backend(dtype, cache_dtype, tolerance):
    """The CPU backend (kernels/cpu/mla_decode.cpp: every token absorbed, as a decode of its own, over the latent
    cache in place) against the torch backend's forward_mla in one step: decodes over contexts of 600 (several chunks,
    parts of 256 keys), 130, 5 and 1, beside a chunk of 5 tokens after 6 cached ones and a whole prompt of 7
    (up-projected by the torch backend); both write the same cache."""
    gen = torch.Generator().manual_seed(2)
    _, w_uk, w_uv = random_layer(gen)
    block_size = 16
    seq_lens, new_tokens = [600, 130, 5, 1, 11, 7], [1, 1, 1, 1, 5, 7]
    needed = [-(n // -block_size) for n in seq_lens]
    pool = torch.randperm(sum(needed) + 3, generator=gen).tolist()  # scattered blocks, a few never used
    tables = [pool[sum(needed[:r]) : sum(needed[: r + 1])] for r in range(len(needed))]
    cache, step, metadata, *_ = paged_batch(gen, block_size, len(pool), seq_lens, new_tokens, tables, cache_dtype)
    step, w_uk, w_uv = [t.to(dtype) for t in step], w_uk.to(dtype), w_uv.to(dtype)
    outputs, caches = [], []
    for backend in (TorchAttentionBackend(block_size), CpuAttentionBackend(block_size)):
        caches.append(cache.clone())
        backend.prepare(metadata)
        outputs.append(backend.forward_mla(*step, caches[-1], metadata, SCALE, w_uk, w_uv))
    assert outputs[1].dtype == dtype and outputs[1].shape == (sum(new_tokens), HEADS, V_DIM)
    torch.testing.assert_close(outputs[1], outputs[0], atol=tolerance, rtol=tolerance)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


def test_auto_picks_the_cpu_backend_for_mla_on_cpu():
    assert isinstance(get_attn_backend("auto", 16, "cpu", frozenset({"mla"})), CpuAttentionBackend)


@pytest.mark.parametrize("layers", [1, 3])
def test_an_mla_model_keeps_one_latent_vector_per_token_and_layer(layers):
    config = tiny_config(
        architecture="DeepseekV2ForCausalLM", num_hidden_layers=layers, kv_lora_rank=RANK, qk_rope_head_dim=ROPE
    )
    (group,) = kv_cache_groups(config)
    assert group.spec == MLAAttentionSpec(RANK, ROPE) and group.spec.head_size == RANK + ROPE
    assert group.layer_ids == tuple(range(layers))
    assert "mla" in config.attention_features()
