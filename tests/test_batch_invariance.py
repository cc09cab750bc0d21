"""Batch invariance on the real SmolLM2, in the dtype --dtype auto picks on this CPU and in float32: a request's
tokens are those it gets alone, cold (a cache salt of its own: no prefix-cache or store hit) and one step per token,
however it is served: on a prefix-cache hit, in chunks, among other requests, preempted and recomputed, reloaded from
the KV store, prefilled by another engine (P/D), verified by n-gram or draft-model speculation, beside other
adapters, and a seeded draw among any neighbours. Tokens are compared exactly: no near-tie allowance."""

import itertools
import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from conftest import SMOLLM2_BLOCK_BYTES
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.lora.request import LoRARequest
from engine.models.loader import check_dtype
from engine.request import Request, SamplingParams
from random_model import save_random_smollm2_shaped

pytestmark = pytest.mark.slow

AUTO = str(check_dtype("auto", "cpu")).removeprefix("torch.")
DTYPES = sorted({AUTO, "float32"})
# Two prompts of 18 and 19 tokens: each spans a chunk of 16 tokens and a cached block of 16.
TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=MAX_TOKENS, ignore_eos=True)
# Neighbours of every kind: greedy, unseeded and seeded draws, with top-k and penalties.
NEIGHBOURS = [
    GREEDY,
    SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.7, top_k=20, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.5, repetition_penalty=1.2, max_tokens=MAX_TOKENS, ignore_eos=True),
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
_ids = itertools.count()


def block_bytes(dtype: str) -> int:
    return SMOLLM2_BLOCK_BYTES // (1 if dtype == "float32" else 2)


def storage(path) -> str:
    return json.dumps(
        {"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {"shared_storage_path": str(path)}}
    )


def run(engine: EngineCore, requests: list[tuple]) -> list[list[int]]:
    """(prompt, params, cache salt, adapter) requests added together and stepped to the end: each one's tokens."""
    ids = []
    for prompt, params, salt, lora in requests:
        ids.append(f"r{next(_ids)}")
        engine.add_request(Request(ids[-1], prompt, params, cache_salt=salt, lora_request=lora))
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[i] for i in ids]


def cold(prompt, params=GREEDY, lora=None) -> tuple:
    """A request whose cache salt is its own: it finds nothing cached, here or in the store."""
    return prompt, params, f"cold-{next(_ids)}", lora


def write_adapter(path, num_layers: int, hidden: int, kv_width: int, rank: int = 8, seed: int = 0) -> None:
    """A PEFT LoRA adapter of random A and B on q_proj and v_proj (small deltas: the model still speaks)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, (module, out) in itertools.product(range(num_layers), [("q_proj", hidden), ("v_proj", kv_width)]):
        key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
        tensors[f"{key}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) / hidden**0.5
        tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.05
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": ["q_proj", "v_proj"]}
    (path / "adapter_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("invariance-lora")
    for i in (1, 2):
        write_adapter(root / f"a{i}", num_layers=30, hidden=576, kv_width=192, seed=i)
    return [LoRARequest(f"a{i}", i, str(root / f"a{i}")) for i in (1, 2)]


@pytest.fixture(scope="module", params=DTYPES)
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def store_dir(dtype, tmp_path_factory):
    return tmp_path_factory.mktemp(f"kv-store-{dtype}")


@pytest.fixture(scope="module")
def engine(dtype, store_dir):
    """The engine most cases run on: prefix caching, the store as its KV connector, and a KV cache of 40 blocks (a
    few requests fit, a crowd is preempted)."""
    args = EngineArgs(dtype=dtype, kv_cache_memory=str(40 * block_bytes(dtype)), kv_transfer_config=storage(store_dir))
    return EngineCore(args)


@pytest.fixture(scope="module")
def one_token_engine(dtype):
    """An engine of one token a step: a prompt is computed position by position, each one a decode."""
    args = EngineArgs(
        dtype=dtype,
        kv_cache_memory=str(40 * block_bytes(dtype)),
        max_num_batched_tokens=1,
        enable_prefix_caching=False,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    return EngineCore(args)


@pytest.fixture(scope="module")
def reference(one_token_engine, prompts):
    """Each prompt alone, cold and one step per token, greedy; and the first prompt seeded."""
    reference = {(i, None): run(one_token_engine, [cold(p)])[0] for i, p in enumerate(prompts)}
    reference[0, SEEDED.seed] = run(one_token_engine, [cold(prompts[0], SEEDED)])[0]
    return reference


def test_prefix_cache_hit(engine, prompts, reference):
    for i, prompt in enumerate(prompts):
        salt = f"hit-{next(_ids)}"
        first = run(engine, [(prompt, GREEDY, salt, None)])[0]
        hits = engine.get_stats().prefix_cache_hits
        again = run(engine, [(prompt, GREEDY, salt, None)])[0]
        assert engine.get_stats().prefix_cache_hits > hits
        assert first == again == reference[i, None], f"prompt {i}"


def test_batch_composition(engine, prompts, reference):
    for i, prompt in enumerate(prompts):
        others = [cold(p, params) for p, params in zip(prompts * 4, NEIGHBOURS * 2) if p is not prompt]
        tokens = run(engine, [*others[:3], cold(prompt), *others[3:]])[3]
        assert tokens == reference[i, None], f"prompt {i}"


def test_seeded_sample_with_neighbours(engine, prompts, reference):
    others = [cold(p, params) for p, params in zip(prompts * 4, NEIGHBOURS * 2) if p is not prompts[0]]
    tokens = run(engine, [*others[:2], cold(prompts[0], SEEDED), *others[2:]])[2]
    assert tokens == reference[0, SEEDED.seed]


def test_preemption_with_recompute(engine, prompts, reference):
    """A crowd of long requests outgrows the 40 blocks: some are preempted and computed again."""
    preemptions = engine.get_stats().num_preemptions
    long = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)  # 8 of them need over 50 blocks
    crowd = [cold(p, long) for p in prompts * 4]
    tokens = run(engine, [*[cold(p) for p in prompts], *crowd])
    assert engine.get_stats().num_preemptions > preemptions
    assert tokens[: len(prompts)] == [reference[i, None] for i in range(len(prompts))]


def test_kv_store_reload(engine, prompts, reference):
    """Computed and stored, then (the local cache forgotten) loaded from the store."""
    salt = f"reload-{next(_ids)}"
    computed = run(engine, [(p, GREEDY, salt, None) for p in prompts])
    assert engine.reset_prefix_cache()
    loaded_before = engine.get_stats().kv_connector_stats["loaded_tokens"]
    reloaded = [run(engine, [(p, GREEDY, salt, None)])[0] for p in prompts]
    assert engine.get_stats().kv_connector_stats["loaded_tokens"] > loaded_before
    assert computed == reloaded == [reference[i, None] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def chunked(dtype, store_dir):
    """An engine of 16 tokens a step: the prefill engine of P/D, which stores what it computes in the main engine's
    store."""
    args = EngineArgs(
        dtype=dtype,
        kv_cache_memory=str(40 * block_bytes(dtype)),
        max_num_batched_tokens=16,
        kv_transfer_config=storage(store_dir),
    )
    return EngineCore(args)


def test_chunked_prefill(chunked, prompts, reference):
    for i, prompt in enumerate(prompts):
        assert run(chunked, [cold(prompt)])[0] == reference[i, None], f"prompt {i}"
    tokens = run(chunked, [cold(p) for p in prompts])  # chunks of several prompts, beside decodes
    assert tokens == [reference[i, None] for i in range(len(prompts))]


def test_prefill_decode_disaggregation(chunked, engine, prompts, reference):
    """The prefill engine computes each prompt (in chunks) and stores it; the decode engine loads it and goes on."""
    salt = f"pd-{next(_ids)}"
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefilled = run(chunked, [(p, one, salt, None) for p in prompts])
    loaded_before = engine.get_stats().kv_connector_stats["loaded_tokens"]
    decoded = [run(engine, [(p, GREEDY, salt, None)])[0] for p in prompts]
    assert engine.get_stats().kv_connector_stats["loaded_tokens"] > loaded_before
    assert decoded == [reference[i, None] for i in range(len(prompts))]
    assert [t[:1] for t in decoded] == prefilled


def test_lora_in_a_mixed_batch(dtype, one_token_engine, prompts, reference, adapters):
    """A prompt with one adapter, beside requests of the other adapter, of the same and of none."""
    kv_cache_memory = str(40 * block_bytes(dtype))
    lora = EngineCore(
        EngineArgs(dtype=dtype, kv_cache_memory=kv_cache_memory, enable_lora=True, max_loras=2, max_lora_rank=8)
    )
    for adapter in adapters:
        assert lora.add_lora(adapter) and one_token_engine.add_lora(adapter)
    alone = run(one_token_engine, [cold(prompts[0], lora=adapters[0])])[0]
    assert alone != reference[0, None]  # the adapter changes the output
    others = [
        cold(p, params, a) for p, params, a in zip(prompts * 2, NEIGHBOURS, [None, adapters[1], None, adapters[0]])
    ]
    assert run(lora, [*others[:2], cold(prompts[0], lora=adapters[0]), *others[2:]])[2] == alone


def spec_engine(dtype, spec) -> EngineCore:
    return EngineCore(EngineArgs(dtype=dtype, kv_cache_memory=str(64 * block_bytes(dtype)), speculative_config=spec))


def test_ngram_speculative_decoding(dtype, prompts, reference):
    engine = spec_engine(dtype, NGRAM)
    tokens = run(engine, [cold(p) for p in prompts])
    assert engine.get_stats().spec_decoding_stats.num_draft_tokens > 0
    assert tokens == [reference[i, None] for i in range(len(prompts))]


def test_draft_model_speculative_decoding(dtype, prompts, reference, smollm2_dir, tmp_path):
    """A tiny random draft over SmolLM2's vocabulary: most drafts are rejected, every verified token must hold."""
    draft = tmp_path / "draft"
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4)
    save_random_smollm2_shaped(draft, **config, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=2048)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (draft / name).write_bytes((smollm2_dir / name).read_bytes())
    engine = spec_engine(dtype, {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3})
    tokens = run(engine, [cold(p) for p in prompts])
    assert engine.get_stats().spec_decoding_stats.num_draft_tokens > 0
    assert tokens == [reference[i, None] for i in range(len(prompts))]


def attention_kernels():
    """(name, attend(query, k_cache, v_cache, query_start_loc, seq_lens, block_table, window) -> out) of the
    kernels this machine runs: the C++ CPU kernel, and the Triton one (under TRITON_INTERPRET=1 without a GPU)."""
    from kernels.cpu_ops import load

    ops = load()

    def cpu(q, k, v, qsl, seq_lens, table, window):
        return ops.paged_attention(q, k, v, qsl, seq_lens, table, 0.25, window, None, None)

    def triton(q, k, v, qsl, seq_lens, table, window):
        from kernels.unified_attention import unified_attention

        out = torch.zeros_like(q)
        unified_attention(out, q, k, v, qsl, seq_lens, table, 0.25, window)
        return out

    return [("cpu", cpu, "cpu"), ("triton", triton, "cuda" if torch.cuda.is_available() else "cpu")]


def numpy_rows_are_invariant() -> bool:
    """Whether numpy's matmul (tl.dot under the Triton interpreter) gives a row of a 16-row tile the same as at the
    tile's first row: some BLAS builds compute a tile's later rows with another micro-kernel, in another order."""
    gen = np.random.default_rng(0)
    a, b = gen.standard_normal((16, 32), dtype=np.float32), gen.standard_normal((32, 32), dtype=np.float32)
    full = a @ b
    return all(np.array_equal((np.pad(a[i : i + 1], ((0, 15), (0, 0))) @ b)[0], full[i]) for i in range(16))


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("kernel", attention_kernels(), ids=lambda k: k[0])
def test_attention_row_is_the_same_as_a_decode(kernel, window):
    """Each query of a prompt (whole, or a chunk over a cached prefix, beside another request) gives bit for bit
    what it gives as a decode alone, over the same cache: past several key tiles and chunks of the kernels."""
    _, attend, device = kernel
    if kernel[0] == "triton" and device == "cpu" and not numpy_rows_are_invariant():
        pytest.skip("under the interpreter tl.dot is numpy's matmul, whose rows here depend on their place in a tile")
    gen = torch.Generator().manual_seed(0)
    seq_len, block_size, kv_heads, group, head_dim = 300 if kernel[0] == "cpu" else 70, 16, 2, 2, 32
    num_blocks = -(-seq_len // block_size)
    dtype = torch.bfloat16 if kernel[0] == "cpu" else torch.float32
    k, v = (torch.randn(kv_heads, num_blocks + 1, block_size, head_dim, generator=gen).to(dtype) for _ in range(2))
    table = torch.randperm(num_blocks + 1, generator=gen)[:num_blocks].view(1, -1)
    queries = torch.randn(seq_len, kv_heads * group, head_dim, generator=gen).to(dtype)
    k, v, queries, table = (t.to(device) for t in (k, v, queries, table))

    def run_step(rows: list[tuple[int, int]]) -> torch.Tensor:
        """One launch of requests (first query position, query count), all over the same sequence."""
        qsl = torch.tensor([0, *itertools.accumulate(n for _, n in rows)], device=device)
        seq_lens = torch.tensor([p + n for p, n in rows], device=device)
        q = torch.cat([queries[p : p + n] for p, n in rows])
        return attend(q, k, v, qsl, seq_lens, table.expand(len(rows), -1).contiguous(), window)

    decodes = torch.cat([run_step([(p, 1)]) for p in range(seq_len)])
    assert torch.equal(run_step([(0, seq_len)]), decodes)  # the whole prompt in one step
    chunk = run_step([(seq_len - 1, 1), (seq_len // 3, seq_len // 2)])  # a decode beside a chunk
    assert torch.equal(chunk[0], decodes[-1])
    assert torch.equal(chunk[1:], decodes[seq_len // 3 : seq_len // 3 + seq_len // 2])


@pytest.mark.parametrize("method", ["float", "int4", "int8"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_is_the_same_alone(method, dtype):
    """A linear layer's row, computed among 40 rows, is bit for bit the row computed alone (on whichever kernel the
    layer's codes and the CPU give it)."""
    from engine.models.linear import Linear, process_weights_after_loading
    from engine.models.quantization import get_linear_method

    gen = torch.Generator().manual_seed(0)
    layer = Linear(576, 200, bias=True, quant_method=get_linear_method(None if method == "float" else method))
    w = torch.randn(200, 576, generator=gen) / 24
    if method != "float":  # a quantized layer's weight takes its shape when it is loaded
        layer.weight.materialize(w.shape, dtype=w.dtype)
    layer.weight.data.copy_(w)
    layer.bias.data.normal_(generator=gen)
    process_weights_after_loading(layer, getattr(torch, dtype))
    x = torch.randn(40, 576, generator=gen).to(getattr(torch, dtype))
    together = layer(x)
    assert torch.equal(together, torch.cat([layer(x[i : i + 1]) for i in range(len(x))]))
