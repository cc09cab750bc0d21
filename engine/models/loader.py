"""The engine's side of model loading: weights (safetensors, or a GGUF converted once) and dtype checks.

A GGUF file (llama.cpp's format) is converted once into a cached HF directory (safetensors, config.json,
tokenizer files) so that every later start only memory-maps safetensors. Its Q8_0, Q4_0, Q4_1, Q4_K and
Q6_K tensors are kept quantized, as int8 codes with float32 scales and zeros per group of 32 (16 for Q6_K;
kernels/quant.py's format: `<name>.qweight`, `.scales`, `.zeros`), which dequantize to exactly the values
the file's own dequantizer gives; other types are dequantized to float32. A mixture of experts' merged
[experts, rows, columns] tensors (Mixtral's, Qwen2-MoE's, Qwen3-MoE's and DeepSeek's) become one tensor an expert, as
Hugging Face checkpoints hold them; the few tensors llama.cpp reshapes otherwise (DeepSeek's kv_b_proj, split in two;
gpt-oss's stacked experts) are put back into their checkpoint's form, in float32. Finding a model and reading its
config and tokenizer needs no torch and lives in files.py.
"""

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.models.config import ModelArchConfig, ModelLoadError
from engine.models.files import (  # noqa: F401 (DEFAULT_MODEL and load_config re-exported for the engine's callers)
    DEFAULT_MODEL,
    build_dir,
    converted_dir,
    gguf_config,
    load_config,
    open_gguf,
    quantized_dir,
    read_json,
    resolve_model,
    write_text_files,
)
from engine.models.quantization import get_linear_method
from kernels.quant import dequantize

logger = logging.getLogger("llmmesh.loader")

# One expert's projection in a checkpoint that holds them per expert.
_EXPERT_WEIGHT = re.compile(r".+\.experts\.\d+\.\w+\.weight")
# Largest safetensors file the converter writes; bounds the memory held while converting big models.
_SHARD_BYTES = 2 << 30


def prepare_model_dir(model: str, cache_dir: str | Path | None = None) -> Path:
    """An HF-format directory with weights for `model`; a GGUF is converted into the cache on first use."""
    path = resolve_model(model)
    if path.is_dir():
        read_json(path / "config.json")  # fail early and clearly on a broken config
        return path
    return build_dir(converted_dir(path, cache_dir), lambda tmp: _convert_gguf(path, tmp))


def prepare_quantized_weights(model_dir: Path, quantization: str, config: ModelArchConfig, cache_dir=None) -> Path:
    """A directory of `model_dir`'s weights with every linear layer's quantized by `quantization` (int8,
    int4), built once into the cache, so later starts load the codes instead of quantizing again."""
    return build_dir(
        quantized_dir(model_dir, quantization, cache_dir),
        lambda tmp: _quantize_weights(model_dir, quantization, config, tmp),
    )


def _quantize_weights(model_dir: Path, quantization: str, config: ModelArchConfig, out: Path) -> None:
    logger.info("quantizing %s's linear layers to %s in %s", model_dir, quantization, out)
    method = get_linear_method(quantization)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}

    def write_shard() -> None:
        file_name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
        shard.clear()

    def add(key: str, tensor: torch.Tensor) -> None:
        if shard and sum(t.nbytes for t in shard.values()) + tensor.nbytes > _SHARD_BYTES:
            write_shard()  # one shard at a time is held in memory
        shard[key] = tensor.contiguous()

    for name, tensor in load_weights(model_dir, dequantized=True):
        # A linear layer's codes replace its weight (an expert's too: Mixtral's are w1, w2, w3); a tied output
        # layer's are made from the embedding, which stays.
        linear = name.endswith("_proj.weight") or name == "lm_head.weight" or bool(_EXPERT_WEIGHT.fullmatch(name))
        if not linear:
            add(name, tensor)
        tied = config.tie_word_embeddings and name.endswith("embed_tokens.weight")
        if linear or tied:
            target = "lm_head" if tied else name.removesuffix(".weight")
            for kind, codes in zip(("qweight", "scales", "zeros"), method.quantize(tensor.float())):
                add(f"{target}.{kind}", codes)
    if shard:
        write_shard()
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}, indent=2))
    (out / "config.json").write_bytes((model_dir / "config.json").read_bytes())  # marks the directory complete


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


def load_weights(model_dir: Path, dequantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF parameter name, tensor as stored) for every tensor of every safetensors file; with
    `dequantized`, a converted GGUF's quantized tensors come as their float32 `<name>.weight`."""
    for path in _weight_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    base, _, kind = name.rpartition(".")
                    if not dequantized or kind not in ("qweight", "scales", "zeros"):
                        yield name, f.get_tensor(name)
                    elif kind == "qweight":
                        codes = (f.get_tensor(f"{base}.{k}") for k in ("qweight", "scales", "zeros"))
                        yield f"{base}.weight", dequantize(*codes)
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
        # As vLLM's CPU backend: bfloat16 where the CPU computes it natively, else float32 (emulated bfloat16 is slow).
        return torch.bfloat16 if cpu_native_bf16() else torch.float32
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


def cpu_native_bf16() -> str | None:
    """The instructions this CPU computes bfloat16 with natively (AMX, AVX512-BF16), or None."""
    if torch.cpu._is_amx_tile_supported():
        return "AMX"
    return "AVX512-BF16" if torch.cpu._is_avx512_bf16_supported() else None


def dtype_reason(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """Why the engine computes in `dtype`, for the start-up report."""
    if str(requested).lower() != "auto":
        return "as --dtype asks"
    if device.type == "cuda":
        return "--dtype auto: bfloat16 where the GPU computes it natively (compute capability 8.0+), else float16"
    native = cpu_native_bf16()
    if native is None:
        return "--dtype auto: float32 on CPU; this CPU has no native bfloat16 (AMX or AVX512-BF16)"
    return f"--dtype auto: bfloat16 on CPU, which this CPU computes natively ({native})"


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
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Where a family's HF names differ (by HF model_type): Phi-3's fused projections, Gemma's four norms a layer.
_GEMMA_LAYER_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# A mixture of experts: the router, each projection of every expert merged into one [experts, rows, columns] tensor
# (split per expert on conversion, "{expert}" below), and Qwen2-MoE's shared expert and its gate.
_QWEN_MOE_LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{expert}.gate_proj",
    "ffn_up_exps": "mlp.experts.{expert}.up_proj",
    "ffn_down_exps": "mlp.experts.{expert}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_DEEPSEEK_LAYER_NAMES = {
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # files from before llama.cpp split it into attn_k_b and attn_v_b
    **{k: v for k, v in _QWEN_MOE_LAYER_NAMES.items() if "shexp" not in k},
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_GGUF_FAMILY_LAYER_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3_text": _GEMMA_LAYER_NAMES,
    "mixtral": {
        "ffn_gate_inp": "block_sparse_moe.gate",
        "ffn_gate_exps": "block_sparse_moe.experts.{expert}.w1",
        "ffn_up_exps": "block_sparse_moe.experts.{expert}.w3",
        "ffn_down_exps": "block_sparse_moe.experts.{expert}.w2",
    },
    "qwen2_moe": _QWEN_MOE_LAYER_NAMES,
    "qwen3_moe": _QWEN_MOE_LAYER_NAMES,
    "deepseek_v2": _DEEPSEEK_LAYER_NAMES,
    "deepseek_v3": _DEEPSEEK_LAYER_NAMES,
    "gpt_oss": {"post_attention_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.router"},
}


def _kv_b_proj(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """llama.cpp's attn_k_b [heads, kv_lora_rank, qk_nope] (transposed for its absorbed attention) and attn_v_b [heads,
    v_head_dim, kv_lora_rank] -> kv_b_proj [heads * (qk_nope + v_head_dim), kv_lora_rank], each head's K rows then V."""
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate and up [E, I, ...] -> [E, 2I, ...] alternating along I, as its checkpoint holds them."""
    return torch.stack([gate, up], dim=2).flatten(1, 2)


# Hugging Face tensors made from GGUF tensors of the same layer otherwise than one name for another, always float:
# (the GGUF tensors, the HF tensor, how). DeepSeek's kv_b_proj split in two and its routing bias (no ".weight"
# suffix); gpt-oss's experts as its checkpoint stacks them ([E, H, 2I] gate and up alternating, [E, I, H]) and its
# attention sinks.
_GGUF_COMBINED = {
    "deepseek_v2": ((("attn_k_b.weight", "attn_v_b.weight"), "self_attn.kv_b_proj.weight", _kv_b_proj),),
    "deepseek_v3": (
        (("attn_k_b.weight", "attn_v_b.weight"), "self_attn.kv_b_proj.weight", _kv_b_proj),
        (("exp_probs_b.bias",), "mlp.gate.e_score_correction_bias", lambda b: b),
    ),
    "gpt_oss": (
        (("ffn_gate_exps.weight", "ffn_up_exps.weight"), "mlp.experts.gate_up_proj",
         lambda gate, up: _interleaved(gate, up).transpose(1, 2)),
        (("ffn_gate_exps.bias", "ffn_up_exps.bias"), "mlp.experts.gate_up_proj_bias", _interleaved),
        (("ffn_down_exps.weight",), "mlp.experts.down_proj", lambda down: down.transpose(1, 2)),
        (("ffn_down_exps.bias",), "mlp.experts.down_proj_bias", lambda b: b),
        (("attn_sinks.weight",), "self_attn.sinks", lambda sinks: sinks),
    ),
}  # fmt: skip
# The families whose attention layers read float weights (DeepSeek's MLA): a GGUF's quantized ones are dequantized.
_GGUF_FLOAT_ATTENTION = ("deepseek_v2", "deepseek_v3")
# Tensors that are metadata, already folded into the config: Llama 3's and Phi-3's rope frequency factors.
_GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def _gguf_hf_name(name: str, model_type: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    base, _, kind = name.rpartition(".")
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    names = {**_GGUF_LAYER_NAMES, **_GGUF_FAMILY_LAYER_NAMES.get(model_type, {})}
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{kind}"
    raise ModelLoadError(f"GGUF tensor {name!r} has no Hugging Face equivalent in the {model_type} architecture")


def _unpermute_rope(w, n_head: int):
    # llama.cpp reorders each head's q/k rows so rotary pairs are adjacent (x0,x1),(x2,x3)...; HF's rotate_half
    # wants the first halves then the second halves. This is the inverse of llama.cpp's permute().
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Types held natively: (elements, bytes) per block.
_NATIVE_TYPES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q6_K": (256, 210)}
# Checkpoint tensors the model fuses into one layer: all of a group are native, or none (the fused layer
# holds one format).
_FUSED_GROUPS = (
    ("attn_q", "attn_k", "attn_v"),
    ("ffn_gate", "ffn_up"),
    ("ffn_gate_exps", "ffn_up_exps"),
    ("ffn_gate_shexp", "ffn_up_shexp"),
)


def _native_names(reader, model_type: str) -> set[str]:
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    combined = {part for parts, _, _ in _GGUF_COMBINED.get(model_type, ()) for part in parts}

    def stays_float(name: str) -> bool:
        part = name.split(".", 2)[-1]
        return part in combined or (model_type in _GGUF_FLOAT_ATTENTION and part.startswith("attn_"))

    # Norms stay float: they are no linear layer, and Gemma's are shifted on conversion. So do the routers (and
    # Qwen2-MoE's shared-expert gate): their layers are unquantized, as in vLLM.
    native = {
        name
        for name, kind in types.items()
        if kind in _NATIVE_TYPES
        and name.endswith(".weight")
        and not name.endswith("norm.weight")
        and ".ffn_gate_inp" not in name
        and not stays_float(name)
    }
    for name in list(native):
        parts = name.split(".")
        for group in _FUSED_GROUPS:
            if len(parts) == 4 and parts[2] in group:
                members = [".".join([*parts[:2], member, parts[3]]) for member in group]
                if not all(m in native or m not in types for m in members):
                    native.discard(name)
    return native


def _f16(raw: np.ndarray) -> np.ndarray:
    """[blocks, 2] bytes -> [blocks, 1] float32."""
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray, run: int) -> np.ndarray:
    """[blocks, bytes] -> [blocks, 2 * bytes]: the low nibbles of each run of `run` bytes, then its high ones."""
    halves = raw.reshape(raw.shape[0], -1, 1, run) >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)
    return (halves & 0x0F).reshape(raw.shape[0], -1)


def _k_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> eight 6-bit scales and eight 6-bit minimums (float32, [blocks, 8])."""
    d, m, both = raw[:, 0:4], raw[:, 4:8], raw[:, 8:12]
    scales = np.concatenate([d & 0x3F, (both & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (both >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def gguf_codes(data: np.ndarray, kind: str, shape: tuple[int, int]) -> tuple[np.ndarray, ...]:
    """A Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensor's raw blocks -> int8 codes [N, K] and float32 scales and zeros
    [N, K // group] (32 elements a group; Q6_K's 16), with codes * scale + zero equal to gguf's dequantization
    bit for bit: every product of a float16 and a 6- or 8-bit integer is exact in float32, and Q4_0's
    d * (q - 8) is q * d + (-8 d), exactly."""
    elements, block_bytes = _NATIVE_TYPES[kind]
    b = np.ascontiguousarray(data).reshape(-1, block_bytes)
    if kind == "Q8_0":
        d = _f16(b[:, 0:2])
        codes, scales, zeros = b[:, 2:].copy().view(np.int8), d, np.zeros_like(d)
    elif kind == "Q4_0":
        d = _f16(b[:, 0:2])
        codes, scales, zeros = _nibbles(b[:, 2:], 16), d, -8 * d
    elif kind == "Q4_1":
        codes, scales, zeros = _nibbles(b[:, 4:], 16), _f16(b[:, 0:2]), _f16(b[:, 2:4])
    elif kind == "Q4_K":
        sub_scales, sub_mins = _k_scales(b[:, 4:16])
        codes, scales, zeros = _nibbles(b[:, 16:], 32), _f16(b[:, 0:2]) * sub_scales, -(_f16(b[:, 2:4]) * sub_mins)
    else:  # Q6_K: 4 low bits, 2 high bits, signed around 32; an int8 scale per 16
        high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        codes = (_nibbles(b[:, :128], 64) | ((high & 0x03).reshape(-1, elements) << 4)).astype(np.int8) - 32
        scales = _f16(b[:, 208:210]) * b[:, 192:208].copy().view(np.int8).astype(np.float32)
        zeros = np.zeros_like(scales)
    n, k = shape
    return codes.astype(np.int8).reshape(n, k), scales.reshape(n, -1), zeros.reshape(n, -1)


def _gguf_tensor(tensor, config: dict, native: bool) -> dict[str, torch.Tensor]:
    """One GGUF tensor as the checkpoint tensors it becomes: {"weight": float32} or qweight/scales/zeros."""
    from gguf.quants import dequantize as gguf_dequantize

    # ggml lists dims fastest-first; PyTorch wants them slowest-first.
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if native:
        # A stack of experts [E, N, K] is E * N rows of codes, as the blocks run along K.
        rows = (int(np.prod(shape[:-1])), shape[-1])
        codes = gguf_codes(tensor.data, tensor.tensor_type.name, rows)
        arrays = {kind: a.reshape(*shape[:-1], -1) for kind, a in zip(("qweight", "scales", "zeros"), codes)}
    else:
        arrays = {
            "weight": gguf_dequantize(tensor.data, tensor.tensor_type).astype("float32", copy=False).reshape(shape)
        }
    if tensor.name.endswith("ffn_gate_inp_shexp.weight"):  # [hidden] in some files; its layer is [1, hidden]
        arrays = {kind: a.reshape(1, -1) for kind, a in arrays.items()}
    # Only llama.cpp's llama converter (Mixtral's too) permutes q/k (rows, in every array).
    if config["model_type"] in ("llama", "mixtral"):
        heads = {".attn_q.": config["num_attention_heads"], ".attn_k.": config["num_key_value_heads"]}
        for part, n_head in heads.items():
            if part in tensor.name:
                arrays = {kind: _unpermute_rope(a, n_head) for kind, a in arrays.items()}
    if config["model_type"] in ("gemma2", "gemma3_text") and tensor.name.endswith("norm.weight"):
        # llama.cpp stores Gemma's RMSNorm weight w as 1 + w (its norm multiplies by the weight alone); HF's is w.
        arrays["weight"] = arrays["weight"] - np.float32(1)
    # An f32 tensor is a view of the read-only memmap; torch wants owned memory.
    return {kind: torch.from_numpy(a if a.flags.writeable else a.copy()) for kind, a in arrays.items()}


def _gguf_tensors(reader, config: dict) -> Iterator[tuple[str, list, "object"]]:
    """(HF name, the gguf tensors it is made of, how: None for one tensor under another name) for every weight."""
    model_type = config["model_type"]
    by_name = {t.name: t for t in reader.tensors}
    combined = {parts[0]: (parts, name, fn) for parts, name, fn in _GGUF_COMBINED.get(model_type, ())}
    members = {part for parts, _, _ in combined.values() for part in parts}
    for t in reader.tensors:
        if t.name in _GGUF_ROPE_TENSORS:
            continue
        block, part = t.name.split(".", 2)[1:] if t.name.startswith("blk.") else ("", t.name)
        if part not in members:
            yield _gguf_hf_name(t.name, model_type), [t], None
        elif part in combined:  # the first of its group; the others join it here
            parts, name, fn = combined[part]
            missing = [p for p in parts if f"blk.{block}.{p}" not in by_name]
            if missing:
                raise ModelLoadError(
                    f"GGUF tensor {t.name!r} comes without {', '.join(f'blk.{block}.{p}' for p in missing)}"
                )
            yield f"model.layers.{block}.{name}", [by_name[f"blk.{block}.{p}"] for p in parts], fn


def _write_weights(reader, config: dict, out: Path) -> None:
    # Group tensors into <= _SHARD_BYTES files, so only one shard is ever held in memory.
    native = _native_names(reader, config["model_type"])

    def nbytes(parts):  # int8 codes and two float32 per group of 16 or 32, or float32
        return sum(int(t.n_elements) * (1 + 8 / 16 if t.name in native else 4) for t in parts)

    shards, size = [[]], 0
    for hf_name, parts, fn in _gguf_tensors(reader, config):
        if shards[-1] and size + nbytes(parts) > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((hf_name, parts, fn))
        size += nbytes(parts)
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for file_name, shard in zip(names, shards):
        tensors = {}
        for hf_name, parts, fn in shard:
            if fn is not None:
                tensors[hf_name] = fn(*(_gguf_tensor(t, config, False)["weight"] for t in parts)).contiguous()
                continue
            t, base = parts[0], hf_name.removesuffix(".weight")
            for kind, tensor in _gguf_tensor(t, config, t.name in native).items():
                if "{expert}" in base:  # merged experts -> one checkpoint tensor each, as HF checkpoints hold them
                    for e, part in enumerate(tensor):
                        tensors[f"{base.format(expert=e)}.{kind}"] = part.clone()
                else:
                    tensors[hf_name if kind == "weight" else f"{base}.{kind}"] = tensor
        save_file(tensors, str(out / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file_name))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _convert_gguf(path: Path, out: Path) -> None:
    logger.info("converting %s to a Hugging Face directory in %s", path, out)
    reader = open_gguf(path)
    config = gguf_config(reader, path)
    ModelArchConfig.from_hf_config(config)  # the engine must be able to use what we write
    _write_weights(reader, config, out)
    write_text_files(reader, path, config, out)
