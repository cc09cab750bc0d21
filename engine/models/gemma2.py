"""Gemma 2 decoder (Gemma2ForCausalLM) over a paged KV cache, built from engine/models/layers.py and Llama's attention.

Llama's shape with Gemma's differences, each as Hugging Face computes it: the embedding scaled by sqrt(hidden_size)
(rounded to the model's dtype first), RMSNorms scaling by 1 + w in float32, a norm after attention and around the MLP,
GeGLU (gelu_pytorch_tanh), the attention scale query_pre_attn_scalar ** -0.5, sliding-window layers between full ones
(layer_types), and tanh soft-capping of the attention scores and of the final logits. Gemma 3 (gemma3.py) adds
q/k norms and a rope of its own for the sliding layers.
"""

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.distributed.parallel_state import get_tp_size, is_first_stage, is_last_stage
from engine.models.config import ModelArchConfig
from engine.models.layers import MLP, Attention, GemmaRMSNorm, RotaryEmbedding, get_rope, use_cpu_ops
from engine.models.linear import (
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_tensor_parallel_size,
    tie_weights,
)
from engine.models.llama import LlamaAttention, LlamaForCausalLM
from engine.models.quantization import get_embedding_method, get_linear_method
from engine.models.utils import first_stage_only, last_stage_only, make_layers, stage_layers


class Gemma2Attention(LlamaAttention):
    """Llama's attention with Gemma's scale and soft cap, and a bias on o_proj too where attention_bias is set."""

    def __init__(
        self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None, layer: int = 0
    ):
        super().__init__(config, backend, quantization, layer)
        if config.attention_bias:
            q_size = config.num_attention_heads * self.head_dim
            self.o_proj = RowParallelLinear(q_size, config.hidden_size, True, get_linear_method(quantization))
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            float(config.hf_config["query_pre_attn_scalar"]) ** -0.5,
            self.num_kv_heads,
            backend,
            config.layer_sliding_window(layer),
            config.hf_config.get("attn_logit_softcapping") or None,
        )


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, self_attn: nn.Module, layer: int, quantization: str | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        # Which rotary embedding the layer takes (Gemma 3's sliding layers have their own).
        self.layer_type = config.layer_types[layer] if config.layer_types else "full_attention"
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = MLP(hidden, config.intermediate_size, quantization, config.hf_config["hidden_activation"])
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x, kv_cache, metadata, cos_sin):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), kv_cache, metadata, cos_sin))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma2ForCausalLM(nn.Module):
    attention_cls = Gemma2Attention  # Gemma 3's adds q/k norms

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        check_tensor_parallel_size(config, get_tp_size())
        self.config = config
        # With pipeline parallelism, this stage's part of the model (as LlamaForCausalLM's).
        self.embed_tokens = first_stage_only(
            lambda: VocabParallelEmbedding(config.vocab_size, config.hidden_size, get_embedding_method(quantization))
        )
        # A buffer, so that model.to(dtype) rounds it as Hugging Face rounds its embed_scale.
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda i: Gemma2DecoderLayer(config, self.attention_cls(config, backend, quantization, i), i, quantization),
        )
        self.norm = last_stage_only(lambda: GemmaRMSNorm(config.hidden_size, config.rms_norm_eps))
        self.rotary = self.make_ropes(config)
        self.attn_backend = backend
        self.final_logit_softcapping = config.hf_config.get("final_logit_softcapping") or None
        self.lm_head = last_stage_only(
            lambda: ParallelLMHead(config.hidden_size, config.vocab_size, get_linear_method(quantization))
        )
        if config.tie_word_embeddings and is_first_stage() and is_last_stage():
            tie_weights(self.lm_head, self.embed_tokens)

    def make_ropes(self, config: ModelArchConfig) -> dict[str, RotaryEmbedding]:
        """Each layer type's rotary embedding: one for all layers in Gemma 2."""
        rope = get_rope(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        return {"full_attention": rope, "sliding_attention": rope}

    def forward(self, input_ids, positions, attn_metadata, kv_caches, intermediate_tensors=None, inputs_embeds=None):
        """As LlamaForCausalLM.forward; inputs_embeds are taken as they are (Gemma 3 scales the text tokens' rows by
        the normalizer and not its image embeddings)."""
        if is_first_stage():
            x = self.embed_tokens(input_ids) * self.normalizer if inputs_embeds is None else inputs_embeds
        else:
            x = intermediate_tensors["hidden_states"]
        cos_sin = {kind: rope(positions, x.dtype) for kind, rope in self.rotary.items()}
        for layer, kv_cache, metadata in zip(
            stage_layers(self.layers, self.start_layer, self.end_layer), kv_caches, attn_metadata
        ):
            x = layer(x, kv_cache, metadata, cos_sin[layer.layer_type])
        return self.norm(x) if is_last_stage() else x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden_states)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def use_cpu_ops(self, ops) -> None:
        """Run RoPE on the C++ CPU kernels; Gemma's norms and GeGLU have none there and stay on torch ops."""
        use_cpu_ops(self, ops)

    # The checkpoint's tensors are named and fused as Llama's.
    _FUSED = LlamaForCausalLM._FUSED
    load_weights = LlamaForCausalLM.load_weights
