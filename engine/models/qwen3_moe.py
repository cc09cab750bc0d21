"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention (per-head q/k norms, biases where attention_bias says) in
Qwen2-MoE's decoder (the same choice of sparse layers), its experts without a shared one; norm_topk_prob says whether
the chosen experts' weights are renormalised."""

from engine.models.qwen2_moe import Qwen2MoeDecoderLayer, Qwen2MoeForCausalLM, QwenMoeBlock
from engine.models.qwen3 import Qwen3Attention


class Qwen3MoeDecoderLayer(Qwen2MoeDecoderLayer):
    attention_cls = Qwen3Attention
    moe_block_cls = QwenMoeBlock


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    decoder_layer_cls = Qwen3MoeDecoderLayer
