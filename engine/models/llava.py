"""LLaVA (LlavaForConditionalGeneration): a CLIP or SigLIP vision tower (engine/models/vision.py), a two-layer
projector and a Llama-family language model (engine/models/llama.py) over the paged KV cache.

An image's embeddings (get_multimodal_embeddings) are the tower's hidden states after vision_feature_layer (the
first one, CLIP's class token, dropped with the "default" strategy) through the projector; the model runner merges
them into the token embeddings at the image's placeholders (get_input_embeddings), vLLM's split.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.config import ModelArchConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.vision import VISION_TOWERS, VisionLanguageModel


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        d = config.hf_config
        v = d["vision_config"]
        self.config = config
        self.language_model = LlamaForCausalLM(config, backend, quantization)
        self.vision_tower = VISION_TOWERS[v.get("model_type", "clip_vision_model")](v)
        self.multi_modal_projector = LlavaMultiModalProjector(
            v["hidden_size"], config.hidden_size, d.get("multimodal_projector_bias", True)
        )
        # transformers' hidden_states[k] is the state after k layers; a negative k counts from after the last.
        layer = d["vision_feature_layer"]
        self.num_vision_layers = layer if layer >= 0 else v["num_hidden_layers"] + 1 + layer
        # transformers drops the first feature with "default" whatever the tower: CLIP's class token, SigLIP's first
        # patch.
        self.drop_first = d.get("vision_feature_select_strategy", "default") == "default"
        self.attn_backend = backend

    def get_multimodal_embeddings(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings, [its placeholder length, hidden_size]."""
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = data["pixel_values"].to(weight.device, weight.dtype)
        features = self.vision_tower(pixel_values, self.num_vision_layers)
        if self.drop_first:
            features = features[:, 1:]
        return self.multi_modal_projector(features)[0]
