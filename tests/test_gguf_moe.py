"""GGUF files of the mixture-of-experts families (Mixtral, as llama.cpp's "llama" with experts; Qwen2-MoE; Qwen3-MoE),
written as llama.cpp's convert_hf_to_gguf.py writes them from a tiny random Hugging Face model (experts merged into
one tensor a projection, routers kept float32), served by the engine and checked against transformers on the same
weights: the model itself for float32 files, its weights through the file's quantization for quantized ones. Then
the quantized experts' layer (GGUF's blocks, int8, int4) against the torch experts on the dequantized weights, and
the GGUF variants that are refused."""

import numpy as np
import pytest
import torch
from test_gguf_families import _copy_with, _vocab

from conftest import HFReference, assert_greedy_matches, run_greedy
from engine.distributed import parallel_state
from engine.models import files, loader
from engine.models.config import ModelLoadError, UnsupportedModelError
from engine.models.fused_moe import FusedMoE, expert_weight_loader, fused_experts, fused_topk
from engine.models.gpt_oss import dequantize_mxfp4
from engine.models.loader import gguf_codes, load_weights
from engine.models.quantization import get_linear_method
from kernels.quant import dequantize

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
_ARCH = {"mixtral": "LLAMA", "qwen2_moe": "QWEN2MOE", "qwen3_moe": "QWEN3MOE"}


def _tiny_model(family: str, vocab_size: int):
    """A random HF model of `family`, four experts a layer, two a token; every parameter random."""
    import transformers

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  num_experts_per_tok=2, tie_word_embeddings=False)  # fmt: skip
    if family == "mixtral":
        config = transformers.MixtralConfig(**common, num_local_experts=4, bos_token_id=1, eos_token_id=2)
    else:
        qwen = dict(num_experts=4, moe_intermediate_size=32, bos_token_id=None, eos_token_id=271, pad_token_id=269)
        if family == "qwen2_moe":  # Qwen1.5-MoE: q/k/v biases, a shared expert, weights not renormalised
            config = transformers.Qwen2MoeConfig(**common, **qwen, shared_expert_intermediate_size=64,
                                                 norm_topk_prob=False)  # fmt: skip
        else:  # transformers' GGUF reading of qwen3moe aside, the head width is the file's key_length
            config = transformers.Qwen3MoeConfig(**common, **qwen, head_dim=32, norm_topk_prob=True)
    return random_model(config)


def random_model(config):
    """transformers' model of `config`, every parameter random."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's llama converter's q/k row order: each head's rotary halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def base_metadata(c, vocab: dict) -> dict:
    """The metadata keys the converter writes for every family, by the writer's add_<key> methods."""
    meta = {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "head_count": c.num_attention_heads,
        "head_count_kv": c.num_key_value_heads,
        "layer_norm_rms_eps": c.rms_norm_eps,
        "rope_freq_base": c.rope_parameters["rope_theta"],
        "expert_used_count": c.num_experts_per_tok,
        "tokenizer_model": vocab["model"],
        "token_list": vocab["tokens"],
        "token_types": vocab["types"],
    }
    meta |= {f"token_{key}": vocab[key] for key in ("scores", "merges") if key in vocab}
    meta |= {"tokenizer_pre": vocab["pre"]} if "pre" in vocab else {}
    meta |= {f"{k}_token_id": getattr(c, f"{k}_token_id") for k in ("bos", "eos") if getattr(c, f"{k}_token_id")}
    return meta


def write_moe_gguf(path, family: str, model, vocab: dict, quantized: bool) -> dict:
    """`model` as llama.cpp's converter writes it; returns its state dict as the file holds it (each quantized tensor
    through gguf's own dequantizer). Quantized: the experts' gate and up as Q4_0, everything else of two dimensions
    as Q8_0 but the routers, which the converter keeps float32."""
    import gguf

    c = model.config
    arch = getattr(gguf.MODEL_ARCH, _ARCH[family])
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    meta = base_metadata(c, vocab)
    if family == "mixtral":
        meta |= {"expert_count": c.num_local_experts, "vocab_size": c.vocab_size,
                 "rope_dimension_count": c.hidden_size // c.num_attention_heads}  # fmt: skip
    else:
        meta |= {"expert_count": c.num_experts, "expert_feed_forward_length": c.moe_intermediate_size}
    if family == "qwen2_moe":
        meta["expert_shared_feed_forward_length"] = c.shared_expert_intermediate_size
    if family == "qwen3_moe":
        meta |= {"key_length": c.head_dim, "value_length": c.head_dim}
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)

    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    stored = {}

    def add(hf_name: str, data: np.ndarray, qtype) -> np.ndarray:
        base, _, kind = hf_name.rpartition(".")
        name = f"{names.get_name(base)}.{kind}"
        if qtype is None or "ffn_gate_inp" in name:
            w.add_tensor(name, data)
            return data
        q = gguf.quants.quantize(data, qtype)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=qtype)
        return gguf.quants.dequantize(q, qtype)

    q8, q4 = (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0) if quantized else (None, None)
    for hf_name, t in model.state_dict().items():
        data = t.float().numpy()
        if hf_name.endswith("experts.gate_up_proj"):  # the converter splits transformers' stacked gate and up
            gate, up = np.split(data, 2, axis=1)
            prefix = hf_name.removesuffix("gate_up_proj")
            stored[hf_name] = np.concatenate(
                [add(f"{prefix}gate_proj.weight", gate, q4), add(f"{prefix}up_proj.weight", up, q4)], axis=1
            )
        elif data.ndim == 1:
            stored[hf_name] = add(hf_name, data, None)
        elif family == "mixtral" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in hf_name else c.num_key_value_heads
            stored[hf_name] = add(hf_name, _permute(data, heads), q8)
            # Quantization blocks run along a row, so un-permuting the stored rows gives the stored weight.
            stored[hf_name] = loader._unpermute_rope(stored[hf_name], heads)
        else:
            # transformers' stacked down_proj has no ".weight"; the converter names it as if it had.
            stored[hf_name] = add(hf_name if hf_name.endswith(".weight") else f"{hf_name}.weight", data, q8)
    _write(w)
    return {name: torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for name, a in stored.items()}


def _write(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _served(tmp_path, monkeypatch, family: str, quantized: bool):
    """(path of the family's GGUF, transformers' model on the weights the file holds, the converted config)."""
    vocab = _vocab("qwen3" if family != "mixtral" else "phi3")
    model = _tiny_model(family, len(vocab["tokens"]))
    path = tmp_path / f"{family}.gguf"
    stored = write_moe_gguf(path, family, model, vocab, quantized)
    model.load_state_dict(stored)
    monkeypatch.setenv("LLMMESH_CACHE_DIR", str(tmp_path / "cache"))
    return path, model, files.gguf_config(files.open_gguf(path), path)


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0-q4_0"])
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_serving_the_moe_gguf_matches_transformers(tmp_path, monkeypatch, family, quantized):
    from engine.config import EngineArgs
    from engine.core import EngineCore

    path, ref, config = _served(tmp_path, monkeypatch, family, quantized)
    hf = ref.config
    assert config["architectures"] == [type(ref).__name__]
    experts = config.get("num_local_experts", config.get("num_experts"))
    assert (experts, config["num_experts_per_tok"]) == (4, hf.num_experts_per_tok)
    if family != "mixtral":
        assert config["moe_intermediate_size"] == hf.moe_intermediate_size and config["mlp_only_layers"] == []
        assert config["norm_topk_prob"] == hf.norm_topk_prob
    if family == "qwen2_moe":
        assert config["shared_expert_intermediate_size"] == hf.shared_expert_intermediate_size

    engine = EngineCore(EngineArgs(model=str(path), dtype="float32", kv_cache_memory="8MiB", block_size=4))
    layers = [m for m in engine.executor.driver_worker.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2 and all((m.w13_codes is not None) == quantized for m in layers)
    if quantized:  # Q4_0 gate and up: 4-bit codes in groups of 32; Q8_0 down
        q13, s13, _ = layers[0].w13_codes
        assert q13.dtype == torch.int8 and int(q13.min()) >= 0 and int(q13.max()) <= 15
        assert q13.shape[-1] // s13.shape[-1] == 32
    assert_serves_like(engine, ref, family)


def assert_serves_like(engine, ref, label: str) -> None:
    """The engine's greedy tokens on three random prompts equal transformers' (the suite's near-tie rule)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(10, ref.config.vocab_size - 10, n).tolist() for n in (3, 13, 21)]
    reference = HFReference(ref)
    for i, (prompt, ours) in enumerate(zip(prompts, run_greedy(engine, prompts, 10))):
        tokens, logits = reference.greedy(prompt, len(ours))
        assert_greedy_matches(ours, tokens, logits, f"{label} prompt {i}")


def test_conversion_splits_the_merged_experts(tmp_path):
    """Each expert's projections of the merged tensors land under its own HF name (Qwen's names; Mixtral's w1, w3,
    w2 and its q/k un-permuted), with the values the file holds."""
    for family in ("qwen2_moe", "mixtral"):
        vocab = _vocab("qwen3" if family != "mixtral" else "phi3")
        model = _tiny_model(family, len(vocab["tokens"]))
        path = tmp_path / family / "m.gguf"
        path.parent.mkdir()
        stored = write_moe_gguf(path, family, model, vocab, quantized=True)
        reader = files.open_gguf(path)
        config = files.gguf_config(reader, path)
        out = path.parent / "converted"
        out.mkdir()
        loader._write_weights(reader, config, out)
        ours = dict(load_weights(out, dequantized=True))
        moe, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2")) if family == "mixtral" else (
            "mlp", ("gate_proj", "up_proj", "down_proj"))  # fmt: skip
        for layer in range(2):
            prefix = f"model.layers.{layer}"
            gate_up, w2 = stored[f"{prefix}.mlp.experts.gate_up_proj"], stored[f"{prefix}.mlp.experts.down_proj"]
            for e in range(4):
                got = [ours[f"{prefix}.{moe}.experts.{e}.{p}.weight"] for p in (gate, up, down)]
                assert torch.equal(torch.cat(got[:2]), gate_up[e]) and torch.equal(got[2], w2[e])
            assert torch.equal(ours[f"{prefix}.{moe}.gate.weight"], stored[f"{prefix}.mlp.gate.weight"])
            assert torch.equal(ours[f"{prefix}.self_attn.q_proj.weight"], stored[f"{prefix}.self_attn.q_proj.weight"])
        if family == "qwen2_moe":
            gate_weight = ours["model.layers.0.mlp.shared_expert_gate.weight"]
            assert gate_weight.shape == (1, 64) and torch.equal(
                gate_weight, stored["model.layers.0.mlp.shared_expert_gate.weight"]
            )
            assert "model.layers.0.mlp.shared_expert.gate_proj.qweight" in set(
                name for name, _ in load_weights(out)
            )  # the shared expert's projections stay quantized


# ---------------------------------------------------------------------------------------------- gpt-oss

# Two layers, the first sliding over a window the prompts run past; YaRN as gpt-oss's own (unrounded ramp).
_GPT_OSS = dict(
    hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256,
    tie_word_embeddings=False, bos_token_id=None, eos_token_id=271, pad_token_id=269,
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 64},
)  # fmt: skip


def _gpt_oss_model(vocab_size: int):
    import transformers

    model = random_model(transformers.GptOssConfig(**_GPT_OSS, vocab_size=vocab_size))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(4.0)
    return model


def _mxfp4(rng, shape: tuple[int, int, int]) -> tuple[np.ndarray, torch.Tensor]:
    """Random MXFP4 blocks of an [E, rows, cols] tensor in GGML's layout (a block of 32 values: its e8m0 scale byte,
    then 16 bytes whose low nibbles are values 0-15 and high nibbles values 16-31), and the float tensor they hold by
    the engine's decoding of the checkpoints' layout (codes in pairs, the low nibble first). Scales up to 2^-1, so that
    the experts' activations reach past the SwiGLU clamp."""
    experts, rows, cols = shape
    codes = rng.integers(0, 16, (experts, rows, cols // 32, 32), dtype=np.uint8)
    scales = rng.integers(122, 127, (experts, rows, cols // 32), dtype=np.uint8)
    blocks = np.concatenate([scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)], axis=-1)
    pairs = torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4))
    return blocks.reshape(experts, rows, -1), dequantize_mxfp4(pairs, torch.from_numpy(scales)).reshape(shape)


def write_gpt_oss_gguf(path, model, vocab: dict, quantized: bool) -> dict:
    """`model` as llama.cpp's converter writes it: gate and up split out of the interleaved gate_up_proj, the experts
    [E, out, in], sinks as attn_sinks.weight; returns its state dict as the file holds it. Quantized: the experts as
    random MXFP4 blocks (in place of the model's), every other tensor of two dimensions as Q8_0 but the router."""
    import gguf

    c, rope = model.config, model.config.rope_parameters
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.GPT_OSS])
    meta = base_metadata(c, vocab) | {
        "expert_count": c.num_local_experts,
        "key_length": c.head_dim,
        "value_length": c.head_dim,
        "rope_scaling_type": gguf.RopeScalingType.YARN,
        "rope_scaling_factor": rope["factor"],
        "rope_scaling_orig_ctx_len": rope["original_max_position_embeddings"],
        "rope_scaling_yarn_beta_fast": rope["beta_fast"],
        "rope_scaling_yarn_beta_slow": rope["beta_slow"],
        "sliding_window": c.sliding_window,
        "expert_feed_forward_length": c.intermediate_size,
    }
    for key, value in meta.items():
        getattr(w, f"add_{key}")(value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, c.num_hidden_layers)
    rng = np.random.default_rng(3)

    def add(hf_name: str, data: torch.Tensor, kind: str = "weight") -> torch.Tensor:
        name = f"{names.get_name(hf_name)}.{kind}"
        if quantized and name.endswith("_exps.weight"):
            blocks, weight = _mxfp4(rng, tuple(data.shape))
            w.add_tensor(name, blocks, raw_shape=blocks.shape, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            return weight
        if not quantized or data.dim() == 1 or "ffn_gate_inp" in name:
            w.add_tensor(name, data.contiguous().numpy())
            return data
        q = gguf.quants.quantize(data.numpy(), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0))

    stored = {}
    for hf_name, t in model.state_dict().items():
        prefix, _, kind = hf_name.rpartition(".")
        if kind in ("gate_up_proj", "gate_up_proj_bias"):  # [E, H, 2I] and [E, 2I], gate and up alternating
            t = t.transpose(1, 2) if kind == "gate_up_proj" else t
            suffix = "weight" if kind == "gate_up_proj" else "bias"
            gate, up = (add(f"{prefix}.{p}", t[:, i::2], suffix) for i, p in enumerate(("gate_proj", "up_proj")))
            both = torch.stack([gate, up], dim=2).flatten(1, 2)
            stored[hf_name] = both.transpose(1, 2) if kind == "gate_up_proj" else both
        elif kind == "down_proj":  # [E, I, H]
            stored[hf_name] = add(hf_name, t.transpose(1, 2)).transpose(1, 2)
        elif kind == "down_proj_bias":
            stored[hf_name] = add(f"{prefix}.down_proj", t, "bias")
        elif kind == "sinks":
            stored[hf_name] = add(hf_name, t)
        else:
            stored[hf_name] = add(prefix, t, kind)
    _write(w)
    return {name: t.float().contiguous() for name, t in stored.items()}


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "mxfp4-q8_0"])
def test_engine_serving_the_gpt_oss_gguf_matches_transformers(tmp_path, monkeypatch, quantized):
    """Float experts (scaled up so that the SwiGLU clamp at llama.cpp's fixed 7.0 bites), or MXFP4 experts dequantized
    as the file converts, against transformers on the same weights; sinks, biases, window and YaRN from the file."""
    from engine.config import EngineArgs
    from engine.core import EngineCore

    vocab = _vocab("qwen3")
    ref = _gpt_oss_model(len(vocab["tokens"]))
    path = tmp_path / "gpt-oss.gguf"
    ref.load_state_dict(write_gpt_oss_gguf(path, ref, vocab, quantized))
    monkeypatch.setenv("LLMMESH_CACHE_DIR", str(tmp_path / "cache"))
    config = files.gguf_config(files.open_gguf(path), path)
    assert config["architectures"] == ["GptOssForCausalLM"] and config["layer_types"] == ref.config.layer_types
    assert config["rope_parameters"]["truncate"] is False and config["sliding_window"] == 8

    engine = EngineCore(EngineArgs(model=str(path), dtype="float32", kv_cache_memory="8MiB", block_size=4))
    layers = [m for m in engine.executor.driver_worker.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2 and all(m.w13_codes is None for m in layers)  # the experts run in float
    gate_up = ref.model.layers[0].mlp.experts.gate_up_proj  # [E, H, 2I], gate and up alternating
    assert torch.equal(layers[0].w13_weight, torch.cat([gate_up[..., 0::2], gate_up[..., 1::2]], dim=2).transpose(1, 2))
    assert_serves_like(engine, ref, "gpt-oss")


# ---------------------------------------------------------------------------------------------- the quantized layer

E, H, N = 6, 256, 256  # experts, hidden size, intermediate size (whole K-quant blocks of 256)


def _gguf_experts(rng, kind: str, rows: int, cols: int):
    """E experts' [rows, cols] projection as a GGUF `kind` tensor's raw blocks -> (codes, scales, zeros) [E, ...]."""
    import gguf

    if kind in ("Q8_0", "Q4_0", "Q4_1"):
        data = (rng.standard_normal((E, rows, cols)) / cols**0.5).astype(np.float32)
        raw = gguf.quants.quantize(data, getattr(gguf.GGMLQuantizationType, kind))
    else:  # K-quants gguf cannot write: random blocks, their super-block scales small enough for weights below 0.2
        elements, block_bytes = loader._NATIVE_TYPES[kind]
        raw = rng.integers(0, 256, (E * rows * cols // elements, block_bytes), dtype=np.uint8)
        scale = np.full((raw.shape[0], 1), 2e-4, dtype=np.float16).view(np.uint8)
        if kind == "Q6_K":  # int8 sub-scales in [-8, 8) times codes in [-32, 32)
            raw[:, 192:208] = rng.integers(-8, 8, (raw.shape[0], 16), dtype=np.int8).view(np.uint8)
            raw[:, 208:210] = np.full((raw.shape[0], 1), 6e-4, dtype=np.float16).view(np.uint8)
        else:  # d and dmin; 6-bit sub-scales and minimums times codes in [0, 16)
            raw[:, 0:4] = np.concatenate([scale, scale], axis=1)
    codes = gguf_codes(raw, kind, (E * rows, cols))
    expected = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, kind)).reshape(E * rows, cols)
    q, s, z = (torch.from_numpy(a.copy()).reshape(E, rows, -1) for a in codes)
    assert torch.equal(dequantize(q.flatten(0, 1), s.flatten(0, 1), z.flatten(0, 1)), torch.from_numpy(expected))
    return q, s, z


def _load_codes(moe: FusedMoE, w1, w3, w2) -> None:
    load = expert_weight_loader(_holder(moe), {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})
    done = []
    for e in range(E):
        for proj, codes in (("gate_proj", w1), ("up_proj", w3), ("down_proj", w2)):
            for kind, t in zip(("qweight", "scales", "zeros"), codes):
                done += load(f"experts.{e}.{proj}.{kind}", t[e])
    assert sorted(done) == ["experts.w13_weight", "experts.w2_weight"]


def _holder(moe: FusedMoE) -> torch.nn.Module:
    holder = torch.nn.Module()
    holder.experts = moe
    return holder


def _dequantized(codes) -> torch.Tensor:
    q, s, z = codes
    return torch.stack([dequantize(q[e], s[e], z[e]) for e in range(q.shape[0])])


def _routing(tokens: int, top_k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, E, generator=gen)
    logits[:, :2] += 2.0  # some experts draw many tokens, some none
    return x, logits


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("types", [("Q8_0", "Q8_0"), ("Q4_K", "Q6_K"), ("Q4_0", "Q4_1")], ids="-".join)
def test_gguf_quantized_experts_match_the_dequantized_float32_experts(types, dtype, tol):
    """GGUF's blocks as the layer holds them (groups of 32; Q6_K's 16 beside Q4_K's 32), on the C++ kernel and on the
    torch experts that dequantize only the routed experts, against fused_experts on the float32 weights the file's own
    dequantizer gives."""
    from kernels.cpu_ops import load

    rng = np.random.default_rng(0)
    w1, w3 = (_gguf_experts(rng, types[0], N, H) for _ in range(2))
    w2 = _gguf_experts(rng, types[1], H, N)
    moe = FusedMoE(E, 2, H, N, True, quantization="gguf")
    _load_codes(moe, w1, w3, w2)
    w13 = torch.cat([_dequantized(w1), _dequantized(w3)], dim=1)
    assert torch.equal(_dequantized(moe.w13_codes), w13) and torch.equal(_dequantized(moe.w2_codes), _dequantized(w2))
    for tokens, top_k in ((1, 1), (37, 2)):
        x, logits = _routing(tokens, top_k, seed=tokens)
        moe.top_k = top_k
        weights, ids = fused_topk(logits, top_k, renormalize=True)
        expected = fused_experts(x, w13, _dequantized(w2), weights, ids)
        moe.ops = None
        torch_path = moe(x.to(dtype), logits)
        moe.ops = load()
        kernel = moe(x.to(dtype), logits)
        assert kernel.dtype == torch_path.dtype == dtype
        for ours in (kernel, torch_path):
            torch.testing.assert_close(ours.float(), expected, atol=tol, rtol=tol)


def test_the_kernel_reads_only_the_routed_experts():
    """Experts no token chose have NaN scales: the output stays finite and equal to the routed experts' alone."""
    from kernels.cpu_ops import load

    rng = np.random.default_rng(1)
    w1, w3 = (_gguf_experts(rng, "Q8_0", N, H) for _ in range(2))
    w2 = _gguf_experts(rng, "Q8_0", H, N)
    x, logits = _routing(5, 2, seed=3)
    logits[:, 2:] = -30.0
    weights, ids = fused_topk(logits, 2, renormalize=True)
    expected = fused_experts(x, torch.cat([_dequantized(w1), _dequantized(w3)], dim=1), _dequantized(w2), weights, ids)
    for codes in (w1, w3, w2):
        codes[1][2:] = float("nan")
    moe = FusedMoE(E, 2, H, N, True, quantization="gguf")
    _load_codes(moe, w1, w3, w2)
    moe.ops = load()
    torch.testing.assert_close(moe(x, logits), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_int8_and_int4_experts_quantize_float_checkpoints_and_match_their_dequantized_experts(quantization):
    """--quantization int8/int4 on float experts (per expert, and transformers' stacked form): the layer holds the
    method's codes (int8: one scale a row; int4: groups of 32 in [0, 15]) and computes the dequantized experts."""
    from kernels.cpu_ops import load

    gen = torch.Generator().manual_seed(4)
    w1, w3 = (torch.randn(E, N, H, generator=gen) / H**0.5 for _ in range(2))
    w2 = torch.randn(E, H, N, generator=gen) / N**0.5
    per_expert = FusedMoE(E, 2, H, N, True, quantization=quantization)
    load_float = expert_weight_loader(_holder(per_expert), {"w1": "w1", "w3": "w3", "w2": "w2"})
    for e in range(E):
        for proj, w in (("w1", w1), ("w3", w3), ("w2", w2)):
            load_float(f"experts.{e}.{proj}.weight", w[e])
    stacked = FusedMoE(E, 2, H, N, True, quantization=quantization)
    stacked.stacked_weight_loader(torch.cat([w1, w3], dim=1), "gate_up_proj")
    stacked.stacked_weight_loader(w2, "down_proj")
    for a, b in zip(per_expert.w13_codes + per_expert.w2_codes, stacked.w13_codes + stacked.w2_codes):
        assert torch.equal(a, b)
    method = get_linear_method(quantization)
    q, s, z = per_expert.w2_codes
    assert all(torch.equal(t[3], m) for t, m in zip((q, s, z), method.quantize(w2[3])))
    x, logits = _routing(9, 2, seed=5)
    weights, ids = fused_topk(logits, 2, renormalize=True)
    w13 = _dequantized(per_expert.w13_codes)
    expected = fused_experts(x, w13, _dequantized(per_expert.w2_codes), weights, ids)
    per_expert.ops = load()
    torch.testing.assert_close(per_expert(x.bfloat16(), logits).float(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(per_expert(x, logits), expected, atol=1e-4, rtol=1e-4)


def test_tensor_parallel_ranks_hold_whole_groups_of_the_quantized_experts(monkeypatch):
    """Two ranks: each holds its rows of gate and up and its columns (whole groups) of down; their outputs sum to
    the whole layer's."""
    rng = np.random.default_rng(2)
    w1, w3 = (_gguf_experts(rng, "Q4_0", N, H) for _ in range(2))
    w2 = _gguf_experts(rng, "Q8_0", H, N)
    x, logits = _routing(7, 2, seed=6)
    whole = FusedMoE(E, 2, H, N, True, quantization="gguf")
    _load_codes(whole, w1, w3, w2)
    monkeypatch.setattr(parallel_state, "_tp_size", 2)
    parts = []
    for rank in range(2):
        monkeypatch.setattr(parallel_state, "_tp_rank", rank)
        moe = FusedMoE(E, 2, H, N, True, quantization="gguf")
        _load_codes(moe, w1, w3, w2)
        assert moe.w2_codes[0].shape == (E, H, N // 2) and moe.w2_codes[1].shape == (E, H, N // 2 // 32)
        parts.append(moe._experts(x, *fused_topk(logits, 2, True)))
    torch.testing.assert_close(parts[0] + parts[1], whole._experts(x, *fused_topk(logits, 2, True)))


# ---------------------------------------------------------------------------------------------- refused variants


def _plain_gguf(tmp_path, family: str):
    vocab = _vocab("qwen3" if family != "mixtral" else "phi3")
    path = tmp_path / f"{family}.gguf"
    if family == "gpt_oss":
        write_gpt_oss_gguf(path, _gpt_oss_model(len(vocab["tokens"])), vocab, quantized=False)
    else:
        write_moe_gguf(path, family, _tiny_model(family, len(vocab["tokens"])), vocab, quantized=False)
    return path


@pytest.mark.parametrize(
    "family, key, value",
    [
        ("qwen3_moe", "qwen3moe.expert_gating_func", 2),  # sigmoid
        ("mixtral", "llama.expert_weights_norm", 0),
        ("qwen2_moe", "qwen2moe.expert_group_count", 4),
        ("gpt_oss", "gpt-oss.attention.sliding_window_pattern", 3),  # llama.cpp slides on every other layer
    ],
)
def test_unimplemented_moe_metadata_is_refused_by_name(tmp_path, family, key, value):
    import gguf

    bad = tmp_path / "bad" / "m.gguf"
    bad.parent.mkdir()
    _copy_with(gguf.GGUFReader(str(_plain_gguf(tmp_path, family))), bad, {key: value})
    with pytest.raises(ModelLoadError, match=rf"{key}=(False|{value}) is not implemented"):
        files.gguf_config(files.open_gguf(bad), bad)


def test_old_per_expert_mixtral_layout_and_deepseek32_are_refused(tmp_path):
    import gguf

    old = tmp_path / "old" / "m.gguf"
    old.parent.mkdir()
    # llama.cpp's layout before merged experts: blk.N.ffn_gate.E.weight, one tensor an expert.
    per_expert = {f"blk.0.ffn_gate.{e}.weight": np.zeros((32, 64), dtype=np.float32) for e in range(4)}
    _copy_with(gguf.GGUFReader(str(_plain_gguf(tmp_path, "mixtral"))), old, {}, per_expert)
    with pytest.raises(ModelLoadError, match=r"one tensor per expert \(blk.N.ffn_gate.E.weight\)"):
        files.gguf_config(files.open_gguf(old), old)

    # DeepSeek-V3.2: V3 with a sparse attention's indexer, which is not implemented.
    deepseek = tmp_path / "ds" / "m.gguf"
    deepseek.parent.mkdir()
    w = gguf.GGUFWriter(str(deepseek), "deepseek32")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    _write(w)
    with pytest.raises(UnsupportedModelError, match="unsupported GGUF architecture 'deepseek32'"):
        files.gguf_config(files.open_gguf(deepseek), deepseek)
