"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache.

Same arithmetic, in the same order, as Hugging Face's implementation, so float32 output
matches it token for token; the differences are the flat batch (no padding) and fused
q/k/v and gate/up projections. On CPU the worker switches the layers to faster kernels after
loading (oneDNN matmuls, kernels/cpu/layers.cpp); those differ from the torch code here by float
rounding only, which the correctness suite holds to Hugging Face as well.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parameter import UninitializedParameter

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.distributed.parallel_state import divide, get_tp_size
from engine.models.config import ModelArchConfig
from engine.models.linear import ColumnParallelLinear, ParallelLMHead, RowParallelLinear, VocabEmbedding, tie_weights
from engine.models.quantization import get_embedding_method, get_linear_method


class RMSNorm(nn.Module):
    ops = None  # the CPU kernels (kernels/cpu/layers.cpp), when the model runs on them

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


def rope_inv_freq(config: ModelArchConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
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
    raise ValueError(f"Unsupported rope_scaling type {rope_type!r}; supported: default, linear, llama3.")


class RotaryEmbedding(nn.Module):
    """Hugging Face's rotate-half RoPE with a precomputed cos/sin table."""

    def __init__(self, config: ModelArchConfig):
        super().__init__()
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # Plain attributes, not buffers: model.to(dtype) must not round them (HF keeps them float32).
        self.cos, self.sin = emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [tokens, head_dim] for this step's positions, looked up once and shared by every layer."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # over the heads
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    ops = None  # as RMSNorm's

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        # This rank's heads and KV heads (check_tensor_parallel_size: they divide by the ranks).
        self.num_heads = config.num_attention_heads // get_tp_size()
        self.num_kv_heads = config.num_key_value_heads // get_tp_size()
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        method = get_linear_method(quantization)
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            config.hidden_size, [q_size, kv_size, kv_size], config.attention_bias, method
        )
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, False, method)
        self.scale = self.head_dim**-0.5
        self.backend = backend

    def forward(self, x, kv_cache, metadata: AttentionMetadata, cos_sin):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, *cos_sin)  # in place
        else:
            q, k = apply_rotary(q, k, *cos_sin)
        out = self.backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    ops = None  # as RMSNorm's

    def __init__(self, config: ModelArchConfig, quantization: str | None = None):
        super().__init__()
        method = get_linear_method(quantization)
        size = config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [size, size], False, method)
        self.down_proj = RowParallelLinear(size, config.hidden_size, False, method)

    def forward(self, x):
        if self.ops is not None:
            return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend, quantization)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, quantization)

    def forward(self, x, kv_cache, metadata, cos_sin):
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, metadata, cos_sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def _cat_rows(shards: list[torch.Tensor]) -> torch.Tensor:
    """Stack fused shards' rows. Quantization scales of different group sizes (GGUF's Q4_K beside Q6_K) are
    repeated to the finest first, which keeps every weight's value."""
    width = max(s.shape[-1] for s in shards) if shards[0].dim() == 2 else None
    return torch.cat([s.repeat_interleave(width // s.shape[-1], dim=-1) if width else s for s in shards], dim=0)


def check_tensor_parallel_size(config: ModelArchConfig, size: int) -> None:
    """A start-up error unless the heads, KV heads and MLP width split evenly over `size` ranks."""
    divide(config.num_attention_heads, size, "the model's attention heads (num_attention_heads)")
    divide(config.num_key_value_heads, size, "the model's KV heads (num_key_value_heads)")
    divide(config.intermediate_size, size, "the model's MLP width (intermediate_size)")


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        check_tensor_parallel_size(config, get_tp_size())
        self.config = config
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, get_embedding_method(quantization))
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, quantization) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        self.attn_backend = backend
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, get_linear_method(quantization))
        if config.tie_word_embeddings:
            tie_weights(self.lm_head, self.embed_tokens)

    def forward(self, input_ids, positions, metadata: AttentionMetadata, kv_caches) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos_sin = self.rotary(positions, x.dtype)
        self.attn_backend.prepare(metadata)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, kv_cache, metadata, cos_sin)
        return self.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def use_cpu_ops(self, ops) -> None:
        """Run the norms, RoPE and SiLU-and-mul on the C++ CPU kernels (kernels.cpu_ops) instead of torch ops."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.ops = ops

    # Checkpoint tensors that are stored separately here but fused above: (fused name, shard index).
    _FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def load_weights(self, weights) -> None:
        """Copy Hugging Face–named tensors in, fusing q/k/v and gate/up as they arrive; each layer keeps its
        rank's part of a full tensor (a fused layer, of each part)."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())

        def shard(name: str, tensor: torch.Tensor) -> torch.Tensor:
            module = modules.get(name.rpartition(".")[0])
            return module.shard(tensor, name) if hasattr(module, "shard") else tensor

        shards: dict[str, dict[int, torch.Tensor]] = {}
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            fused = self._FUSED.get(parts[-2]) if len(parts) >= 2 else None
            if fused is not None:
                fused_name = ".".join(parts[:-2] + [fused[0], parts[-1]])
                group = shards.setdefault(fused_name, {})
                group[fused[1]] = shard(fused_name, tensor)
                if len(group) == (3 if fused[0] == "qkv_proj" else 2):
                    self._copy(params, fused_name, _cat_rows([group[i] for i in sorted(group)]))
                    loaded.add(fused_name)
                    del shards[fused_name]
                continue
            self._copy(params, name, shard(name, tensor))
            loaded.add(name)
        # A GGUF layer has parameters for both of the forms a tensor may arrive in; its method checks one came.
        optional = {n for n, p in params.items() if isinstance(p, UninitializedParameter)}
        missing = set(params) - loaded - optional - ({"lm_head.weight"} if self.config.tie_word_embeddings else set())
        if missing or shards:
            raise ValueError(f"Checkpoint is missing weights: {sorted(missing | set(shards))[:8]}")

    @staticmethod
    def _copy(params, name, tensor):
        if name not in params:
            raise ValueError(f"Checkpoint has an unexpected weight {name!r}")
        param = params[name]
        if isinstance(param, UninitializedParameter):  # its shape and dtype are the checkpoint's
            param.materialize(tensor.shape, dtype=tensor.dtype)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
