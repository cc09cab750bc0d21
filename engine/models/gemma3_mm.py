"""Gemma 3 with its vision tower (Gemma3ForConditionalGeneration): a SigLIP tower (engine/models/vision.py), a
projector that average-pools the tower's patches to mm_tokens_per_image, norms and projects them, and the Gemma 3
text model (engine/models/gemma3.py) over the paged KV cache.

An image's embeddings (get_multimodal_embeddings) replace its placeholders' token embeddings unscaled (the text
tokens' are scaled by sqrt(hidden_size)), as transformers merges them. The language model attends both ways within
each image's placeholders (a prefix-LM mask, ModelArchConfig.is_mm_prefix_lm): the scheduler puts an image's
placeholders in one step and the attention backend unmasks them (AttentionMetadata.mm_prefix_range); on a
sliding-window layer the window still bounds the keys before a query.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.config import ModelArchConfig
from engine.models.gemma3 import Gemma3ForCausalLM
from engine.models.layers import GemmaRMSNorm
from engine.models.vision import SiglipVisionModel, VisionLanguageModel


class Gemma3MultiModalProjector(nn.Module):
    def __init__(self, v: dict, text_hidden: int, mm_tokens_per_image: int):
        super().__init__()
        self.mm_input_projection_weight = nn.Parameter(torch.empty(v["hidden_size"], text_hidden))
        self.mm_soft_emb_norm = GemmaRMSNorm(v["hidden_size"], v.get("layer_norm_eps", 1e-6))
        self.patches_per_side = v["image_size"] // v["patch_size"]
        self.kernel_size = self.patches_per_side // round(mm_tokens_per_image**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[images, patches, vision hidden] -> [images, mm_tokens_per_image, text hidden]."""
        b, _, hidden = x.shape
        grid = x.transpose(1, 2).reshape(b, hidden, self.patches_per_side, self.patches_per_side)
        pooled = F.avg_pool2d(grid, self.kernel_size).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        d = config.hf_config
        v = d["vision_config"]
        self.config = config
        self.language_model = Gemma3ForCausalLM(config, backend, quantization)
        self.vision_tower = SiglipVisionModel(v)
        self.multi_modal_projector = Gemma3MultiModalProjector(v, config.hidden_size, d["mm_tokens_per_image"])
        self.image_token_id = d["image_token_index"]
        self.attn_backend = backend

    def get_multimodal_embeddings(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings, [mm_tokens_per_image, hidden_size]: the tower's last_hidden_state, projected."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        pixel_values = data["pixel_values"].to(weight.device, weight.dtype)
        tower = self.vision_tower
        features = tower.post_layernorm(tower(pixel_values, len(tower.encoder.layers)))
        return self.multi_modal_projector(features)[0]

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The image token may lie past the vocabulary; its rows are replaced by the image's embeddings anyway.
        input_ids = input_ids.masked_fill(input_ids == self.image_token_id, 0)
        lm = self.language_model
        return lm.embed_tokens(input_ids) * lm.normalizer
