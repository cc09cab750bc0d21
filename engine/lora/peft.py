"""Reading a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) and checking it against the model.

Every refusal is a ValueError naming the adapter and what is wrong (a file by its name, never its directory): a
missing or unreadable file, one larger than its rank and target modules allow (checked before it is read), a rank
above --max-lora-rank, a target module we do not serve, a tensor whose shape is not this base model's.
"""

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load as load_safetensors

from engine.lora.request import LoRARequest
from engine.models.config import ModelArchConfig

# The projections an adapter may target, by PEFT's (Hugging Face's) module names: Phi-3's are fused (FUSED_MODULES).
SUPPORTED_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
)
# A fused projection and the projections it holds, in output order. Its adapter (one A, one B over all of its output
# rows) is theirs with A shared and B cut by their rows, which is how it is served: each tensor-parallel rank then
# takes its rows of each, as of the fused weight.
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes
HEADER_BYTES_PER_TENSOR = 256  # a safetensors header's entry: the key, dtype, shape and offsets, as JSON
# PEFT's key for one LoRA matrix: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight")


@dataclass
class LoRAModel:
    """One adapter in host memory, float32: (layer, module) -> (A [r, in], B [out, r] with the scaling folded in); a
    fused module's under each module it holds (FUSED_MODULES)."""

    lora_request: LoRARequest
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    # Identifies the delta the adapter computes (its weights and scaling): the prefix cache's extra key.
    digest: bytes


def module_shapes(cfg: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each target module in this base model."""
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
        "qkv_proj": (h, q + 2 * kv),
        "gate_up_proj": (h, 2 * i),
    }


def _read_bounded(name: str, file: Path, max_bytes: int, what: str) -> bytes:
    """A file of at most max_bytes, its size checked before it is read (and read no further, should it grow);
    the messages name the file, never its directory."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise ValueError(f"LoRA adapter {name!r}: {file.name} is {size} bytes, over the {max_bytes} {what}.")
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"LoRA adapter {name!r}: cannot read {file.name}: {e.strerror}") from None
    if len(data) > max_bytes:
        raise ValueError(f"LoRA adapter {name!r}: {file.name} grew past {max_bytes} bytes while read.")
    return data


def max_weights_bytes(config: dict, rank: int, cfg: ModelArchConfig) -> int:
    """The most an adapter_model.safetensors of this rank over its target modules can hold: A and B of every
    target module of every layer in float32 (the widest dtype an adapter is served from), and a header of
    HEADER_BYTES_PER_TENSOR each."""
    shapes = module_shapes(cfg)
    targets = config.get("target_modules") or list(shapes)
    targets = [targets] if isinstance(targets, str) else list(targets)
    per_layer = sum(rank * sum(shapes[t]) for t in targets if t in shapes)
    tensors = 2 * len(targets) * cfg.num_hidden_layers
    return 4 * per_layer * cfg.num_hidden_layers + HEADER_BYTES_PER_TENSOR * tensors + 8


# The most of a safetensors header read to look at its tensors' names before the file's size is judged.
MAX_PEEKED_HEADER_BYTES = 16 * 2**20


def _refuse_expert_tensors(name: str, file: Path) -> None:
    """PEFT's tensors for a mixture of experts (mlp.experts.lora_A, mlp.shared_expert.*), named from the file's
    header alone (its first 8 bytes give the header's length); a header too long or unreadable is left to the
    checks that follow."""
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= MAX_PEEKED_HEADER_BYTES:
                return
            header = json.loads(f.read(length))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return
    experts = sorted(k for k in header if "expert" in k) if isinstance(header, dict) else []
    if experts:
        raise _experts_refused(name, experts[0])


def _experts_refused(name: str, key: str) -> ValueError:
    return ValueError(
        f"LoRA adapter {name!r}: tensor {key!r} adapts a mixture-of-experts layer's experts; LoRA on experts is not "
        "supported (target the attention projections)."
    )


def _read_config(name: str, path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json does not exist (a PEFT directory is needed).")
    data = _read_bounded(name, config_file, MAX_CONFIG_BYTES, "bytes an adapter_config.json may have")
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not readable JSON: {e}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json must be a PEFT config with peft_type LORA.")
    return config


def _check_config(name: str, config: dict, max_lora_rank: int) -> tuple[int, float]:
    """The rank and the scaling (lora_alpha / r, or / sqrt(r) with rsLoRA)."""
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json's r must be an integer >= 1, got {rank!r}.")
    if rank > max_lora_rank:
        raise ValueError(
            f"LoRA adapter {name!r}: its rank {rank} is above --max-lora-rank {max_lora_rank}; "
            "raise --max-lora-rank or use an adapter of a lower rank."
        )
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json's lora_alpha must be a number, got {alpha!r}.")
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unsupported = sorted(t for t in targets if t not in SUPPORTED_TARGET_MODULES)
    if unsupported:
        raise ValueError(
            f"LoRA adapter {name!r}: target module(s) {unsupported} are not supported; "
            f"supported: {', '.join(SUPPORTED_TARGET_MODULES)}."
        )
    for key, why in (
        ("modules_to_save", "full copies of modules"),
        ("rank_pattern", "per-module ranks"),
        ("alpha_pattern", "per-module alphas"),
        ("use_dora", "DoRA"),
    ):
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {key} ({why}) is not supported.")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias must be 'none', got {config.get('bias')!r}.")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return rank, scaling


def load_peft_adapter(lora_request: LoRARequest, cfg: ModelArchConfig, max_lora_rank: int) -> LoRAModel:
    """Read and check a PEFT directory for this base model."""
    name, path = lora_request.lora_name, Path(lora_request.lora_path)
    config = _read_config(name, path)
    rank, scaling = _check_config(name, config, max_lora_rank)
    weights_file = path / "adapter_model.safetensors"
    max_bytes = max_weights_bytes(config, rank, cfg)
    _refuse_expert_tensors(name, weights_file)  # before the size check: experts' tensors are what make it large
    data = _read_bounded(name, weights_file, max_bytes, f"bytes rank {rank} over its target modules can take")
    try:
        tensors = load_safetensors(data)
    except Exception as e:  # noqa: BLE001 (not safetensors: all the same to the caller)
        raise ValueError(f"LoRA adapter {name!r}: cannot read {weights_file.name}: {e}") from None
    shapes = module_shapes(cfg)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in sorted(tensors.items()):  # sorted: the first fault named does not depend on file order
        match = _KEY.fullmatch(key)
        if "expert" in key:  # PEFT's keys for a mixture of experts: mlp.experts.lora_A, mlp.shared_expert.*
            raise _experts_refused(name, key)
        if match is None or match.group(2) not in shapes:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA matrix of a supported module "
                f"({', '.join(SUPPORTED_TARGET_MODULES)})."
            )
        layer, module, which = int(match.group(1)), match.group(2), match.group(3)
        if layer >= cfg.num_hidden_layers:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}, but the base model has "
                f"{cfg.num_hidden_layers} layers: the adapter is for another base model."
            )
        fan_in, fan_out = shapes[module]
        expected = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(tensor.shape) != expected:
            raise ValueError(
                f"LoRA adapter {name!r}: tensor {key!r} has shape {tuple(tensor.shape)}, expected {expected} "
                f"(rank {rank}): the adapter is for another base model."
            )
        parts.setdefault((layer, module), {})[which] = tensor.float()
    weights = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {module} has lora_{list(ab)[0]} alone.")
        a, b = ab["A"].contiguous(), ab["B"] * scaling
        parts_of = FUSED_MODULES.get(module, (module,))
        for part, part_b in zip(parts_of, b.split([shapes[p][1] for p in parts_of])):
            if (layer, part) in weights:
                raise ValueError(f"LoRA adapter {name!r}: layer {layer}'s {part} is adapted twice (alone and fused).")
            weights[layer, part] = (a, part_b.contiguous())
    if not weights:
        raise ValueError(f"LoRA adapter {name!r}: {weights_file.name} holds no LoRA matrices.")
    digest = hashlib.sha256(data + repr(scaling).encode()).digest()
    return LoRAModel(lora_request, rank, scaling, weights, digest)
