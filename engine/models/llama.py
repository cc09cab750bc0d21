"""Llama-family decoder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) over a paged KV cache, built
from engine/models/layers.py.

Same arithmetic, in the same order, as Hugging Face's implementation, so float32 output
matches it token for token; the differences are the flat batch (no padding) and fused
q/k/v and gate/up projections. On CPU the worker switches the layers to faster kernels after
loading (oneDNN matmuls, kernels/cpu/layers.cpp); those differ from the torch code here by float
rounding only, which the correctness suite holds to Hugging Face as well.
"""

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.distributed.parallel_state import get_tp_size
from engine.models.config import ModelArchConfig
from engine.models.layers import MLP, Attention, RMSNorm, apply_rotary, get_rope, use_cpu_ops
from engine.models.linear import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_tensor_parallel_size,
    tie_weights,
)
from engine.models.quantization import get_embedding_method, get_linear_method


class LlamaAttention(nn.Module):
    ops = None  # the CPU kernels' RoPE, when the model runs on them (layers.RMSNorm's)

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
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, backend)

    def forward(self, x, kv_cache, metadata: AttentionMetadata, cos_sin):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, *cos_sin)  # in place
        else:
            q, k = apply_rotary(q, k, *cos_sin)
        out = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(-1, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, backend, quantization)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, quantization)

    def forward(self, x, kv_cache, metadata, cos_sin):
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, metadata, cos_sin)
        return x + self.mlp(self.post_attention_layernorm(x))


def _cat_rows(shards: list[torch.Tensor]) -> torch.Tensor:
    """Stack fused shards' rows. Quantization scales of different group sizes (GGUF's Q4_K beside Q6_K) are
    repeated to the finest first, which keeps every weight's value."""
    width = max(s.shape[-1] for s in shards) if shards[0].dim() == 2 else None
    return torch.cat([s.repeat_interleave(width // s.shape[-1], dim=-1) if width else s for s in shards], dim=0)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        check_tensor_parallel_size(config, get_tp_size())
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, get_embedding_method(quantization)
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, backend, quantization) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = get_rope(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
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
        use_cpu_ops(self, ops)

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
