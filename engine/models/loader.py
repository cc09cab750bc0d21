"""The engine's side of model loading: weights (safetensors, or a GGUF converted once) and dtype checks.

A GGUF file (llama.cpp's format) is converted once into a cached HF directory (float32 safetensors,
config.json, tokenizer files) so that every later start only memory-maps safetensors. Finding a model
and reading its config and tokenizer needs no torch and lives in files.py.
"""

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.config import ModelConfig, ModelLoadError
from engine.models.files import (  # noqa: F401 (DEFAULT_MODEL and load_config re-exported for the engine's callers)
    DEFAULT_MODEL,
    build_dir,
    converted_dir,
    gguf_config,
    load_config,
    open_gguf,
    read_json,
    resolve_model,
    write_text_files,
)

logger = logging.getLogger("llmmesh.loader")

# Largest safetensors file the converter writes; bounds the memory held while converting big models.
_SHARD_BYTES = 2 << 30


def prepare_model_dir(model: str, cache_dir: str | Path | None = None) -> Path:
    """An HF-format directory with weights for `model`; a GGUF is converted into the cache on first use."""
    path = resolve_model(model)
    if path.is_dir():
        read_json(path / "config.json")  # fail early and clearly on a broken config
        return path
    return build_dir(converted_dir(path, cache_dir), lambda tmp: _convert_gguf(path, tmp))


# ---------------------------------------------------------------------------------------------- HF directory


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
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
        except Exception as e:  # noqa: BLE001 (whatever the device raises means the dtype does not work there)
            problem = str(e).splitlines()[0] if str(e) else type(e).__name__
    if problem:
        raise ModelLoadError(f"dtype {dtype!r} cannot run on device {device!r} ({problem}); allowed values: {allowed}")
    return result


def _cuda_bf16(dev: torch.device) -> bool:
    # Native bf16 needs compute capability >= 8.0; older GPUs only emulate it, slowly.
    return torch.cuda.get_device_capability(dev)[0] >= 8


# ---------------------------------------------------------------------------------------------- GGUF

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
    logger.info("converting %s to a Hugging Face directory in %s", path, out)
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    ModelConfig.from_hf_config(config)  # the engine must be able to use what we write
    _write_weights(reader, config, out)
    write_text_files(reader, path, config, out)
