"""Quantized weights (engine/models/quantization.py, kernels/quant.py): GGUF's blocks against gguf's own
dequantizer, each quantized layer against its dequantized float32 reference, greedy output against Hugging
Face on the same dequantized weights, and the start-up errors of combinations that cannot run."""

import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import assert_no_leaks, run_greedy
from engine.config import EngineArgs
from engine.core import EngineCore
from engine.models.linear import Linear, process_weights_after_loading
from engine.models.loader import gguf_codes
from engine.models.quantization import CPU_KERNEL_MAX_ROWS, get_linear_method
from engine.request import Request, SamplingParams
from kernels.quant import (
    dequantize,
    group_gemv_kernel,
    group_linear_ref,
    int4_linear,
    int4_scales_and_zeros,
    int8_dot_kernel,
    int8_dot_linear_ref,
    pack_int4,
    pack_int8_dot,
    quantize_int4,
    quantize_int8,
    quantize_rows_int8,
)
from test_models import save_random_model

# A bfloat16 layer output against the float32 reference on the same dequantized weight: the activations are
# rounded to bfloat16 (8 bits) and the kernels accumulate in float32, so the largest error stays within 1% of
# the output's largest magnitude (measured: 0.24-0.47%).
BF16_REL_TOL = 1e-2


def gguf_blocks(kind: str, shape=(96, 256), seed=0):
    """Random weights quantized by gguf into `kind`'s blocks; our codes of them, and gguf's dequantized values."""
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    data = quants.quantize(w, GGMLQuantizationType[kind])
    codes = tuple(torch.from_numpy(a) for a in gguf_codes(data, kind, shape))
    return codes, torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind]))


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_blocks_hold_exactly_ggufs_values(kind):
    codes, want = gguf_blocks(kind)
    assert codes[0].dtype == torch.int8 and codes[1].shape == (96, 256 // 32)
    assert torch.equal(dequantize(*codes), want)


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_gguf_k_quant_blocks_hold_exactly_ggufs_values(kind):
    """gguf cannot quantize K-quants, so the blocks are random bytes with finite float16 scales."""
    from gguf import GGMLQuantizationType, quants

    from engine.models.loader import _NATIVE_TYPES

    elements, block_bytes = _NATIVE_TYPES[kind]
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (48 * 512 // elements, block_bytes), dtype=np.uint8)
    halves = rng.uniform(-0.05, 0.05, (len(blocks), 2)).astype(np.float16).view(np.uint8)
    fields = [0, 1, 2, 3] if kind == "Q4_K" else [208, 209]  # d and dmin, or d
    blocks[:, fields] = halves[:, : len(fields)]
    data = blocks.reshape(48, -1)
    codes = tuple(torch.from_numpy(a) for a in gguf_codes(data, kind, (48, 512)))
    want = torch.from_numpy(quants.dequantize(data, GGMLQuantizationType[kind]))
    assert codes[1].shape == (48, 512 // (32 if kind == "Q4_K" else 16))
    assert torch.equal(dequantize(*codes), want)


def test_fused_shards_of_different_group_sizes_keep_their_values():
    """q/k in Q4_K (groups of 32) and v in Q6_K (groups of 16) fuse into one qkv layer of groups of 16."""
    from engine.models.utils import _cat_rows

    q = quantize_int4(torch.randn(8, 64), 32)
    v = quantize_int8(torch.randn(4, 64), 16)
    fused = [_cat_rows([a, b]) for a, b in zip(q, v)]
    assert fused[1].shape == (12, 4)
    assert torch.equal(dequantize(*fused), torch.cat([dequantize(*q), dequantize(*v)]))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_int4_packing_holds_exactly_ggufs_values(kind):
    """The packed int4 weight, read back through the kernel in float32 (x = identity), is gguf's dequantization
    bit for bit: the kernel's (q - 8) * scale + (zero + 8 scale) is exact for float16 scales and minimums."""
    codes, want = gguf_blocks(kind)
    packed = pack_int4(codes[0], torch.device("cpu"))
    eye = torch.eye(want.shape[1])
    assert torch.equal(int4_linear(eye, packed, 32, int4_scales_and_zeros(codes[1], codes[2], torch.float32)).T, want)


def _layer(method: str, seed=0):
    """A Linear(256 -> 96, bias) of `method` as loading leaves it, and the codes its weight is made of."""
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(256, 96, bias=True, quant_method=get_linear_method(method.split("-")[0]))
    layer.bias.data.normal_(generator=gen)
    if method == "int8" or method == "int4":
        w = torch.randn(96, 256, generator=gen)
        layer.weight.materialize(w.shape, dtype=w.dtype)
        layer.weight.data.copy_(w)
        codes = quantize_int8(w, 256) if method == "int8" else quantize_int4(w, 32)
    else:
        codes, _ = gguf_blocks(method.split("-")[1].upper(), seed=seed)
        for name, tensor in zip(("qweight", "scales", "zeros"), codes):
            getattr(layer, name).materialize(tensor.shape, dtype=tensor.dtype)
            getattr(layer, name).data.copy_(tensor)
    return layer, codes


# int8: _weight_int8pack_mm; int4, gguf-q4_*, gguf-q8_0: int8_dot_linear (kernels/cpu/quant.cpp) where the CPU
# has AVX512-VNNI or AVX2, else the int4 kernel and group_gemv.
METHODS = ["int8", "int4", "gguf-q4_0", "gguf-q4_1", "gguf-q8_0"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("rows", [1, CPU_KERNEL_MAX_ROWS + 7])  # the quantized kernel's rows, then oneDNN's
@pytest.mark.parametrize("batch_invariant", [False, True])  # each row count's fastest kernel, or one for all
def test_bfloat16_layer_matches_its_dequantized_reference(method, rows, batch_invariant):
    layer, codes = _layer(method)
    bias = layer.bias.detach().clone()
    process_weights_after_loading(layer, torch.bfloat16, batch_invariant)
    assert layer.kernel is not None or batch_invariant
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1))
    want = group_linear_ref(x, *codes) + bias
    got = layer(x.bfloat16())
    assert got.dtype == torch.bfloat16
    error = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert error < BF16_REL_TOL, f"{method}, {rows} rows: relative error {error:.4f}"


@pytest.mark.parametrize("group_size", [16, 32])  # Q6_K's and Q8_0's
@pytest.mark.parametrize("rows", [1, 3, 6])  # the kernel takes rows four at a time
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_gemv_matches_its_dequantized_reference(group_size, rows, dtype):
    codes = quantize_int8(torch.randn(96, 256, generator=torch.Generator().manual_seed(0)), group_size)
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    got, want = group_gemv_kernel()(x, *codes), group_linear_ref(x.float(), *codes)
    assert got.dtype == dtype
    error = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert error < (BF16_REL_TOL if dtype == torch.bfloat16 else 1e-6), f"relative error {error:.2e}"


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 17])  # eight rows at a time: one chunk, and three
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dot_linear_matches_its_reference(bits, rows, dtype):
    """The integer kernel against the dequantized weight times the int8-rounded activations, in float32; 100
    columns leave the last tile of 16 part empty."""
    kernel = int8_dot_kernel()
    if kernel is None:
        pytest.skip("int8_dot_linear needs AVX512-VNNI or AVX2")
    w = torch.randn(100, 256, generator=torch.Generator().manual_seed(0))
    codes = quantize_int4(w, 32) if bits == 4 else gguf_blocks("Q8_0", shape=(100, 256))[0]
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    got, want = kernel(x, *pack_int8_dot(*codes)), int8_dot_linear_ref(x.float(), *codes)
    assert got.dtype == dtype and got.shape == (rows, 100)
    error = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert error < (BF16_REL_TOL if dtype == torch.bfloat16 else 1e-5), f"relative error {error:.2e}"


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_dot_linear_is_exact_at_the_extreme_codes(bits):
    """Codes at both ends of their range against activations of magnitude 127 after rounding, in every pairing: the
    integer dot products must not saturate (AVX2's 16-bit pair sums would, taken naively for 8-bit codes)."""
    kernel = int8_dot_kernel()
    if kernel is None:
        pytest.skip("int8_dot_linear needs AVX512-VNNI or AVX2")
    gen = torch.Generator().manual_seed(0)
    low, high = (0, 15) if bits == 4 else (-128, 127)
    q = torch.where(torch.rand(48, 256, generator=gen) < 0.5, low, high).to(torch.int8)
    q[0], q[1] = high, low  # whole columns at one end: every pair of products at its largest
    scales, zeros = torch.ones(48, 8), torch.zeros(48, 8)
    x = torch.where(torch.rand(3, 256, generator=gen) < 0.5, -1.0, 1.0)
    x[0] = 1.0
    got = kernel(x, *pack_int8_dot(q, scales, zeros))
    want = F.linear(quantize_rows_int8(x).double(), dequantize(q, scales, zeros).double())
    error = ((got.double() - want).abs().max() / want.abs().max()).item()
    assert error < 1e-6, f"relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dot_linear_rounds_the_activations_as_quantize_rows_int8(dtype):
    """Against the identity (codes 1 on the diagonal, scales 1), the output is each activation as the kernel rounded
    it, bit for bit: ties to even (a block of absmax 127 scales by 1), saturation and all-zero blocks included."""
    kernel = int8_dot_kernel()
    if kernel is None:
        pytest.skip("int8_dot_linear needs AVX512-VNNI or AVX2")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=gen) * 3
    x[0, :32] = torch.arange(-16, 16) + 0.5
    x[0, 0] = 127.0
    x[1, 32:] = 0.0
    x[2] = torch.randint(-300, 300, (64,), generator=gen) / 2
    x = x.to(dtype)
    got = kernel(x, *pack_int8_dot(torch.eye(64, dtype=torch.int8), torch.ones(64, 2), torch.zeros(64, 2)))
    assert torch.equal(got, quantize_rows_int8(x).to(dtype))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_dot_linear_row_is_the_same_in_any_batch(bits, dtype):
    """Batch invariance of the kernel itself: each row of a call of 1 to 17 rows is bit for bit the row computed
    alone, whichever run of rows it falls in."""
    kernel = int8_dot_kernel()
    if kernel is None:
        pytest.skip("int8_dot_linear needs AVX512-VNNI or AVX2")
    w = torch.randn(100, 256, generator=torch.Generator().manual_seed(0))
    codes = quantize_int4(w, 32) if bits == 4 else gguf_blocks("Q8_0", shape=(100, 256))[0]
    packed = pack_int8_dot(*codes)
    x = torch.randn(17, 256, generator=torch.Generator().manual_seed(1)).to(dtype)
    alone = torch.cat([kernel(x[i : i + 1], *packed) for i in range(len(x))])
    for rows in range(1, len(x) + 1):
        assert torch.equal(kernel(x[:rows], *packed), alone[:rows]), f"{rows} rows"


def test_int8_dot_linear_takes_float16_scales_only():
    """It reads float16 scales and zeros: codes whose scales are not float16 values stay on the other kernels."""
    q, scales, zeros = quantize_int8(torch.randn(16, 64, generator=torch.Generator().manual_seed(0)), 32)
    assert not torch.equal(scales.half().float(), scales) and pack_int8_dot(q, scales, zeros) is None
    assert pack_int8_dot(q, scales.half().float(), zeros) is not None


@pytest.mark.parametrize("method", ["gguf-q4_1", "gguf-q8_0"])
def test_float32_gguf_layer_runs_the_exact_dequantized_weight(method):
    layer, codes = _layer(method)
    bias = layer.bias.detach().clone()
    process_weights_after_loading(layer, torch.float32)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), group_linear_ref(x, *codes) + bias, atol=1e-4, rtol=1e-5)


def _dequantize_hf_weights(hf_model, method: str) -> None:
    """Replace each of the Hugging Face model's linear weights by its dequantized codes (float32)."""
    quantize = (lambda w: quantize_int8(w, w.shape[1])) if method == "int8" else (lambda w: quantize_int4(w, 32))
    with torch.no_grad():
        for module in hf_model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize(*quantize(module.weight)))


# Greedy tokens of the bfloat16 engine against Hugging Face in float32 on the same dequantized weights.
# Token identity cannot hold (bfloat16 activations move these logits, of magnitude about 15, by tenths), so
# each token the engine chose is scored by the reference: it must be the reference's top-1 at >= 85% of
# positions (measured: 45 of 48 for int8, 43 of 48 for int4 on int8_dot_linear), and its logit at most 5% of the
# largest logit magnitude under the reference's top anywhere (measured: 1.1% for int8, 3.2% for int4).
MIN_TOP1_AGREEMENT, MAX_LOGIT_REGRET = 0.85, 0.05


def assert_agrees_with(
    hf_model, prompts: list[list[int]], outputs: list[list[int]], label: str, max_regret: float = MAX_LOGIT_REGRET
) -> None:
    """Score each greedy token of ours with the reference's logits at its position (one forward per prompt)."""
    agree, total, regret = 0, 0, 0.0
    for prompt, ours in zip(prompts, outputs):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
        chosen = logits[torch.arange(len(ours)), torch.tensor(ours)]
        agree += int((logits.argmax(-1) == torch.tensor(ours)).sum())
        total += len(ours)
        regret = max(regret, ((logits.max(-1).values - chosen) / logits.abs().max()).max().item())
    assert agree / total >= MIN_TOP1_AGREEMENT, f"{label}: top-1 agreement {agree}/{total}"
    assert regret <= max_regret, f"{label}: a chosen token's logit is {regret:.1%} (of the largest) under the top"


# With --batch-invariant on (the default) a prefill's rows, too, have their activations rounded to int8 (every row on
# the quantized kernel), and so with off where oneDNN takes no bfloat16 (a CPU without AVX-512: int8_dot_linear then
# runs every step); docs/determinism.md gives the wider bound that costs.
MAX_LOGIT_REGRET_INVARIANT = 0.07


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("batch_invariant", ["off", "on"])
def test_greedy_agrees_with_hf_on_the_dequantized_weights(tmp_path, method, batch_invariant):
    """The engine quantizing at load (bfloat16; decode steps of <= 4 rows on the quantized kernels)."""
    path, hf_model = save_random_model(tmp_path, "llama3-rope-untied")
    _dequantize_hf_weights(hf_model, method)
    args = EngineArgs(
        model=str(path), dtype="bfloat16", quantization=method, kv_cache_memory="8MiB", block_size=8,
        download_dir=str(tmp_path / "cache"), batch_invariant=batch_invariant,
    )  # fmt: skip
    engine = EngineCore(args)
    # Off, decodes take the quantized kernel; on, int8's per-channel codes run dequantized on dense_linear.
    layer = engine.worker.model.layers[0].mlp.down_proj
    assert layer.kernel is not None or batch_invariant == "on"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (5, 17, 40)]
    every_row = batch_invariant == "on" or (layer.kernel is not None and layer.kernel_max_rows is None)
    bound = MAX_LOGIT_REGRET_INVARIANT if every_row else MAX_LOGIT_REGRET
    assert_agrees_with(hf_model, prompts, run_greedy(engine, prompts, 16), method, bound)
    assert_no_leaks(engine)


def test_weights_quantized_at_load_are_cached_on_disk(tmp_path, caplog):
    """The first start quantizes the float checkpoint's linear layers into the cache; the next loads those codes
    without quantizing again and gives the same tokens."""
    path, _ = save_random_model(tmp_path, "llama3-rope-untied")
    cache = tmp_path / "cache"
    prompts = [[5, 9, 200, 31, 7], list(range(3, 40))]
    outputs = []
    for start in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="llmmesh.loader"):
            engine = EngineCore(
                EngineArgs(
                    model=str(path),
                    dtype="bfloat16",
                    quantization="int4",
                    kv_cache_memory="8MiB",
                    download_dir=str(cache),
                )
            )
        assert sum("quantizing" in r.getMessage() for r in caplog.records) == (1 if start == 0 else 0)
        outputs.append(run_greedy(engine, prompts, 8))
        assert_no_leaks(engine)
    assert outputs[0] == outputs[1]
    (cached,) = cache.glob(f"{path.name}-int4-*")
    stored = {}
    for f in cached.glob("*.safetensors"):
        stored.update(load_file(f))
    original = load_file(path / "model.safetensors")
    assert not [n for n in stored if n.endswith("_proj.weight") or n == "lm_head.weight"]
    for layer in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head"):
        want = quantize_int4(original[f"{layer}.weight"].float(), 32)
        for kind, tensor in zip(("qweight", "scales", "zeros"), want):
            assert torch.equal(stored[f"{layer}.{kind}"], tensor), (layer, kind)
    assert torch.equal(stored["model.embed_tokens.weight"], original["model.embed_tokens.weight"])


# The shipped SmolLM2 GGUF, native (its Q4_1 layers and Q8_0 output layer on int8_dot_linear, the activations
# rounded to int8 per block of 32), in bfloat16, scored by Hugging Face's float32 model on the same file (its own
# dequantizer): top-1 agreement and logit regret within the bounds above (measured: 62 of 64, 0.6%), and each
# chosen token's logprob within MAX_LOGPROB_ERROR nats of the reference's (measured: 0.17).
SMOLLM2_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,", "1, 1, 2, 3, 5, 8,"]
MAX_LOGPROB_ERROR = 0.3


def test_smollm2_gguf_native_bfloat16_agrees_with_hf(hf_smollm2, tokenizer):
    engine = EngineCore(EngineArgs(dtype="bfloat16", kv_cache_memory="64MiB"))
    assert engine.worker.quantization == "gguf"
    # Batch invariance on a CPU without the int8-activation kernel (no AVX2) multiplies by the dequantized weight.
    has_kernel = engine.worker.model.layers[0].self_attn.qkv_proj.kernel is not None
    assert has_kernel or engine.args.batch_invariant == "on"
    prompts = [tokenizer(p).input_ids for p in SMOLLM2_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(str(i), prompt, params))
    tokens, logprobs = {str(i): [] for i in range(len(prompts))}, {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += out.new_logprobs.logprobs[:, 0].tolist()
    outputs = [tokens[str(i)] for i in range(len(prompts))]
    assert_agrees_with(hf_smollm2.model, prompts, outputs, "SmolLM2 GGUF")
    error = 0.0
    for i, (prompt, ours) in enumerate(zip(prompts, outputs)):
        with torch.inference_mode():
            logits = hf_smollm2.model(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1 : -1]
        want = logits.log_softmax(-1)[torch.arange(len(ours)), torch.tensor(ours)]
        error = max(error, (want - torch.tensor(logprobs[str(i)])).abs().max().item())
    assert error <= MAX_LOGPROB_ERROR, f"a chosen token's logprob is {error:.3f} from the reference's"
    assert_no_leaks(engine)


def test_bad_combinations_fail_at_start_up(tmp_path):
    with pytest.raises(ValueError, match=r"quantization must be one of int8, int4, gguf \(or unset\), got 'int3'"):
        EngineArgs(quantization="int3")
    path, _ = save_random_model(tmp_path, "mistral")
    with pytest.raises(ValueError, match="--quantization int4 computes in bfloat16 or float16.*--dtype bfloat16"):
        EngineCore(EngineArgs(model=str(path), quantization="int4", dtype="float32", kv_cache_memory="8MiB"))
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf model file"):
        EngineCore(EngineArgs(model=str(path), quantization="gguf", dtype="bfloat16", kv_cache_memory="8MiB"))


def test_kv_blocks_of_differently_quantized_engines_never_mix(tmp_path):
    path, _ = save_random_model(tmp_path, "mistral")
    fingerprints = {
        EngineCore(
            EngineArgs(
                model=str(path), dtype="bfloat16", quantization=q, kv_cache_memory="8MiB", download_dir=str(tmp_path)
            )
        )
        .worker.kv_layouts[0]
        .fingerprint
        for q in (None, "int8", "int4")
    }
    assert len(fingerprints) == 3


def test_start_up_reports_the_dtype_and_why(tmp_path, caplog):
    from engine.models.loader import cpu_native_bf16

    path, _ = save_random_model(tmp_path, "mistral")
    with caplog.at_level("INFO", logger="llmmesh.engine"):
        EngineCore(EngineArgs(model=str(path), dtype="auto", kv_cache_memory="8MiB"))
    native = cpu_native_bf16()
    assert (
        f"Computing in bfloat16 (--dtype auto: bfloat16 on CPU, which this CPU computes natively ({native}))"
        if native
        else "Computing in float32 (--dtype auto: float32 on CPU; this CPU has no native bfloat16"
    ) in caplog.text
    assert "quantization: none" in caplog.text


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["int4", "gguf-q4_1"])
def test_cuda_int4_layer_matches_its_dequantized_reference(method):
    layer, codes = _layer(method)
    bias = layer.bias.detach().clone()
    layer = layer.cuda()
    process_weights_after_loading(layer, torch.bfloat16)
    assert layer.kernel is not None and layer.kernel_max_rows is None
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    want = group_linear_ref(x, *codes) + bias
    got = layer(x.bfloat16().cuda()).float().cpu()
    assert ((got - want).abs().max() / want.abs().max()).item() < BF16_REL_TOL
