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

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.distributed.parallel_state import get_ep_size, get_tp_size, is_first_stage, is_last_stage
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
from engine.models.utils import first_stage_only, last_stage_only, load_fused_weights, make_layers, stage_layers


class LlamaAttention(nn.Module):
    ops = None  # the CPU kernels, for RoPE, once layers.use_cpu_ops sets them

    def __init__(
        self,
        config: ModelArchConfig,
        backend: AttentionBackend,
        quantization: str | None = None,
        layer: int = 0,
        o_proj_bias: bool = False,
    ):
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
        self.o_proj = RowParallelLinear(q_size, config.hidden_size, o_proj_bias, method)
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            backend,
            config.layer_sliding_window(layer),
        )

    def forward(self, x, kv_cache, metadata: AttentionMetadata, cos_sin):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.norm_qk(q, k)
        if self.ops is not None:
            self.ops.rotary_embedding(q, k, *cos_sin)  # in place
        else:
            q, k = apply_rotary(q, k, *cos_sin)
        out = self.attn(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(-1, self.q_size))

    def norm_qk(self, q, k):
        """Where a family normalises q and k before RoPE (Qwen3); Llama does not."""
        return q, k


class LlamaDecoderLayer(nn.Module):
    attention_cls = LlamaAttention

    def __init__(
        self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None, layer: int = 0
    ):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_cls(config, backend, quantization, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, quantization, layer)

    def make_mlp(self, config: ModelArchConfig, quantization: str | None, layer: int) -> nn.Module:
        """The layer's feed-forward block: the dense gated MLP here; a mixture of experts in the MoE families."""
        return MLP(config.hidden_size, config.intermediate_size, quantization)

    def forward(self, x, kv_cache, metadata, cos_sin):
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, metadata, cos_sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    decoder_layer_cls = LlamaDecoderLayer

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        check_tensor_parallel_size(config, get_tp_size(), get_ep_size() > 1)
        self.config = config
        # With pipeline parallelism: this stage's layers only; the embedding on the first, the norm and LM head on
        # the last (engine.models.utils.make_layers).
        self.embed_tokens = first_stage_only(
            lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, get_embedding_method(quantization))
        )
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers, lambda i: self.decoder_layer_cls(config, backend, quantization, i)
        )
        self.norm = last_stage_only(lambda: RMSNorm(config.hidden_size, config.rms_norm_eps))
        self.rotary = get_rope(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        self.attn_backend = backend
        self.lm_head = last_stage_only(
            lambda: ParallelLMHead(config.hidden_size, config.vocab_size, get_linear_method(quantization))
        )
        if config.tie_word_embeddings and is_first_stage() and is_last_stage():
            tie_weights(self.lm_head, self.embed_tokens)

    def forward(
        self,
        input_ids,
        positions,
        attn_metadata: list[AttentionMetadata],
        kv_caches,
        intermediate_tensors=None,
        inputs_embeds=None,
    ) -> torch.Tensor:
        """attn_metadata, kv_caches: each of this stage's layers'; attn_metadata already prepared
        (engine.attention.backend.layer_metadata). A stage after the first starts from the previous one's hidden
        states (intermediate_tensors); one before the last returns its hidden states unnormed. inputs_embeds: the
        tokens' embeddings where a vision-language model merged images into them (None: input_ids')."""
        if not is_first_stage():
            x = intermediate_tensors["hidden_states"]
        else:
            x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos_sin = self.rotary(positions, x.dtype)
        for layer, kv_cache, metadata in zip(
            stage_layers(self.layers, self.start_layer, self.end_layer), kv_caches, attn_metadata
        ):
            x = layer(x, kv_cache, metadata, cos_sin)
        return self.norm(x) if is_last_stage() else x

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
        """Copy Hugging Face–named tensors in, fusing q/k/v and gate/up as they arrive."""
        load_fused_weights(self, weights, self._FUSED, self.config.tie_word_embeddings)
