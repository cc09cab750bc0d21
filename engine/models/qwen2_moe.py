"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's decoder (q/k/v biases where qkv_bias says) with a sparse mixture of
experts as the MLP of every decoder_sparse_step-th layer not in mlp_only_layers (the others keep a dense MLP of
intermediate_size). A sparse layer adds to its routed experts (norm_topk_prob: their weights renormalised) a shared
expert, a dense MLP every token passes through, scaled by a sigmoid gate of its own."""

import torch
from torch import nn

from engine.models.config import ModelArchConfig
from engine.models.fused_moe import SparseMoeBlock, expert_weight_loader
from engine.models.layers import MLP
from engine.models.linear import Linear
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from engine.models.utils import load_fused_weights

# The checkpoint's per-expert projections -> FusedMoE's parts (gate, up, down).
QWEN_EXPERT_PROJS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def num_experts(config: ModelArchConfig) -> int:
    """Qwen's num_experts (transformers >= 5 writes Qwen3-MoE's as num_local_experts)."""
    hf = config.hf_config
    return int(hf["num_local_experts"] if "num_local_experts" in hf else hf["num_experts"])


def is_sparse_layer(config: ModelArchConfig, layer: int) -> bool:
    """Whether layer `layer` has experts, as transformers' Qwen MoE decoder decides."""
    hf = config.hf_config
    return (
        layer not in (hf.get("mlp_only_layers") or [])
        and num_experts(config) > 0
        and (layer + 1) % hf["decoder_sparse_step"] == 0
    )


class QwenMoeBlock(SparseMoeBlock):
    """Qwen's routed experts, sized and routed by its config (Qwen3-MoE's whole sparse block)."""

    def __init__(self, config: ModelArchConfig, quantization: str | None = None):
        hf = config.hf_config
        super().__init__(
            config.hidden_size,
            num_experts(config),
            hf["num_experts_per_tok"],
            hf["moe_intermediate_size"],
            hf["norm_topk_prob"],
            quantization,
        )


class Qwen2MoeSparseMoeBlock(QwenMoeBlock):
    def __init__(self, config: ModelArchConfig, quantization: str | None = None):
        super().__init__(config, quantization)
        self.shared_expert = MLP(config.hidden_size, config.hf_config["shared_expert_intermediate_size"], quantization)
        self.shared_expert_gate = Linear(config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class Qwen2MoeDecoderLayer(LlamaDecoderLayer):
    moe_block_cls = Qwen2MoeSparseMoeBlock  # Qwen3-MoE's has no shared expert

    def make_mlp(self, config: ModelArchConfig, quantization: str | None, layer: int) -> nn.Module:
        if is_sparse_layer(config, layer):
            return self.moe_block_cls(config, quantization)
        return super().make_mlp(config, quantization, layer)


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Qwen2MoeDecoderLayer

    def load_weights(self, weights) -> None:
        experts = expert_weight_loader(self, QWEN_EXPERT_PROJS)
        load_fused_weights(self, weights, self._FUSED, self.config.tie_word_embeddings, experts)
