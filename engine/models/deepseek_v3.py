"""DeepSeek-V3 (DeepseekV3ForCausalLM): DeepSeek-V2's multi-head latent attention and experts (deepseek_v2.py) with
V3's router: sigmoid scores, the choice made on the scores plus e_score_correction_bias, among the topk_group groups
whose two best experts sum highest; the chosen experts weighted by their scores without the bias, renormalised where
norm_topk_prob says, times routed_scaling_factor. RoPE pairs interleaved dims unless rope_interleave is off. The
checkpoint's multi-token-prediction layers (past num_hidden_layers) are not run, and not loaded."""

import re

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.config import ModelArchConfig
from engine.models.deepseek_v2 import (
    DeepseekV2DecoderLayer,
    DeepseekV2ForCausalLM,
    DeepseekV2MoE,
    experts_of_best_groups,
)

_LAYER = re.compile(r"(?:model\.)?layers\.(\d+)\.")


class DeepseekV3MoE(DeepseekV2MoE):
    def __init__(self, config: ModelArchConfig, quantization: str | None = None):
        super().__init__(config, quantization)
        self.norm_topk_prob = config.hf_config["norm_topk_prob"]
        # The checkpoint keeps it beside the router's weight (mlp.gate.e_score_correction_bias).
        self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(self.gate.out_features), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
        choice = scores + self.gate.e_score_correction_bias.float()
        group_scores = choice.view(choice.shape[0], self.num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        expert_mask = experts_of_best_groups(group_scores, self.topk_groups, choice.shape[-1])
        ids = torch.topk(choice.masked_fill(~expert_mask, float("-inf")), self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    moe_cls = DeepseekV3MoE


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    decoder_layer_cls = DeepseekV3DecoderLayer

    def load_weights(self, weights) -> None:
        num_layers = self.config.num_hidden_layers

        def decoder_weights():
            for name, tensor in weights:
                layer = _LAYER.match(name)
                if layer is None or int(layer[1]) < num_layers:
                    yield name, tensor

        super().load_weights(decoder_weights())
