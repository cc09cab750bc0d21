"""The layers a decoder family is built from, in vLLM's names: RMSNorm (and Gemma's), the rotary embedding (get_rope),
the gated MLP, and Attention (the call into the attention backend). The weight-bearing linear, embedding and LM-head layers,
with their tensor-parallel split and quantization methods, are engine/models/linear.py's.

Each computes what Hugging Face's layers compute, in the same order, so float32 output matches it token for token.
A layer with an `ops` attribute runs on the C++ CPU kernels (kernels/cpu/layers.cpp) once use_cpu_ops() sets it;
those differ from the torch code here by float rounding only.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.models.config import ROPE_TYPES
from engine.models.linear import ColumnParallelLinear, RowParallelLinear
from engine.models.quantization import get_linear_method


class RMSNorm(nn.Module):
    ops = None  # the CPU kernels, when the model runs on them

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: the checkpoint stores w with the scale 1 + w, applied in float32 before the cast back (the
    CPU kernel's RMSNorm rounds first and scales by w, so this layer has no `ops`)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x.float()
        out = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


# ---------------------------------------------------------------------------------------------- rotary embedding


def rope_inv_freq(head_dim: int, base: float, rope_scaling: dict | None, max_position: int) -> torch.Tensor:
    """The inverse frequencies of each rope type, as transformers' modeling_rope_utils computes them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    if rope_type == "dynamic":
        # Dynamic NTK raises the base once a forward pass reaches past max_position_embeddings (transformers then
        # recomputes inv_freq for the new length). The engine never runs a position there (max_model_len is at most
        # max_position_embeddings), so transformers' own value at that length (its formula at seq_len =
        # max_position_embeddings, in its order of operations) holds for every sequence served.
        factor = scaling["factor"]
        base = base * ((factor * max_position / max_position) - (factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, base, scaling, max_position)
    if rope_type == "longrope":
        # The short factors; LongRoPERotaryEmbedding adds the long ones for sequences past the original length.
        return longrope_inv_freq(head_dim, base, scaling["short_factor"])
    raise ValueError(f"Unsupported rope_scaling type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}.")


def longrope_inv_freq(head_dim: int, base: float, ext_factors: list[float]) -> torch.Tensor:
    inv_freq_shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base**inv_freq_shape)


def _yarn_inv_freq(head_dim: int, base: float, scaling: dict, max_position: int) -> torch.Tensor:
    """YaRN: interpolated (divided by factor) frequencies for the dimensions that turn fewer than beta_slow times over
    the original context, the original ones for those turning more than beta_fast times, a linear ramp between."""
    factor = scaling.get("factor") or max_position / scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1
    old_len = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations):
        return (head_dim * math.log(old_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers does, against a division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(rope_scaling: dict | None, max_position: int) -> float:
    """The factor transformers multiplies cos and sin by (yarn's and longrope's mscale; 1 for the other types)."""
    scaling = rope_scaling or {}
    rope_type = scaling.get("rope_type", "default")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    old_len = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / old_len
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))

    def mscale(scale, m=1):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


class RotaryEmbedding(nn.Module):
    """Hugging Face's rotate-half RoPE with a precomputed cos/sin table (scaled by the rope type's attention factor,
    as transformers scales them)."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, base, rope_scaling, max_position)
        scale = rope_attention_factor(rope_scaling, max_position)
        # Plain attributes, not buffers: model.to(dtype) must not round them (HF keeps them float32).
        self.cos, self.sin = cos_sin_table(inv_freq, max_position, scale)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, head_dim] for this step's positions, looked up once and shared by every layer."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def cos_sin_table(inv_freq: torch.Tensor, num_positions: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scale, emb.sin() * scale


class LongRoPERotaryEmbedding(RotaryEmbedding):
    """LongRoPE (Phi-3) past its original length: transformers rotates a sequence of at most
    original_max_position_embeddings tokens with the short factors, and a longer one with the long factors from its
    first token on. One table holds both, as vLLM's long_short cache: rows [0, original) short, then every position
    long; the model runner offsets the positions of a request longer than original (ModelArchConfig.rope_switch_len)
    by original, so each token finds its request's factors and a batch mixes both."""

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict):
        nn.Module.__init__(self)
        original = rope_scaling["original_max_position_embeddings"]
        scale = rope_attention_factor(rope_scaling, max_position)
        short = cos_sin_table(longrope_inv_freq(head_dim, base, rope_scaling["short_factor"]), original, scale)
        long = cos_sin_table(longrope_inv_freq(head_dim, base, rope_scaling["long_factor"]), max_position, scale)
        self.cos, self.sin = (torch.cat(pair) for pair in zip(short, long))


def get_rope(head_dim: int, max_position: int, base: float, rope_scaling: dict | None) -> RotaryEmbedding:
    """The rotary embedding for a rope_scaling dict (None or rope_type "default": plain RoPE)."""
    scaling = rope_scaling or {}
    if scaling.get("rope_type") == "longrope" and max_position > scaling["original_max_position_embeddings"]:
        return LongRoPERotaryEmbedding(head_dim, max_position, base, scaling)
    return RotaryEmbedding(head_dim, max_position, base, rope_scaling)


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over the heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


# ---------------------------------------------------------------------------------------------- attention and MLP


class Attention(nn.Module):
    """Attention over the paged KV cache: writes this step's k and v, attends q to the cache through the backend.
    q, k and v are [tokens, heads, head_dim] of this rank's heads, rotary already applied.

    sliding_window: a query sees only the last sliding_window keys (itself included); logits_soft_cap: scores are
    capped as cap * tanh(score / cap) before the softmax (Gemma 2); sinks: this rank's heads' attention sinks, a
    learned logit a head that joins the softmax's denominator and attends to no value (gpt-oss)."""

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        scale: float,
        num_kv_heads: int,
        backend: AttentionBackend,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        sinks: torch.Tensor | None = None,
    ):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale = scale
        self.backend = backend
        self.sliding_window, self.logits_soft_cap, self.sinks = sliding_window, logits_soft_cap, sinks

    def forward(self, q, k, v, kv_cache, metadata: AttentionMetadata) -> torch.Tensor:
        args = (self.scale, self.sliding_window, self.logits_soft_cap, self.sinks)
        return self.backend.forward(q, k, v, kv_cache, metadata, *args)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """vLLM's SiluAndMul: silu(gate) * up over the fused [gate | up] halves."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """vLLM's GeluAndMul(approximate="tanh") (GeGLU): gelu_pytorch_tanh(gate) * up over the fused halves."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# hidden_act -> the gated activation over [gate | up].
ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}


class MLP(nn.Module):
    """gate/up/down with an activation-and-mul; gate and up fused in one column-parallel layer."""

    ops = None  # as RMSNorm's

    def __init__(
        self, hidden_size: int, intermediate_size: int, quantization: str | None = None, hidden_act: str = "silu"
    ):
        super().__init__()
        method = get_linear_method(quantization)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [intermediate_size, intermediate_size], False, method)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, method)
        self.act_fn = ACTIVATIONS[hidden_act]

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        # The CPU kernels implement SiLU-and-mul only; any other activation stays on torch.
        if self.ops is not None and self.act_fn is silu_and_mul:
            return self.down_proj(self.ops.silu_and_mul(gate_up))
        return self.down_proj(self.act_fn(gate_up))


def use_cpu_ops(model: nn.Module, ops) -> None:
    """Run every layer that has CPU kernels (those with an `ops` attribute) on them instead of torch ops."""
    for module in model.modules():
        if hasattr(module, "ops"):
            module.ops = ops
