"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector and a Llama-family language
model (engine/models/llama.py) over the paged KV cache.

An image's embeddings (get_multimodal_embeddings) are the tower's hidden states after vision_feature_layer (the
class token dropped with the "default" strategy) through the projector; the model runner merges them into the
token embeddings at the image's placeholders (get_input_embeddings), vLLM's split. The tower runs each image whole
with bidirectional attention; it is small beside the language model and is not sharded across tensor-parallel ranks.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend, AttentionMetadata
from engine.models.config import ModelArchConfig
from engine.models.layers import use_cpu_ops
from engine.models.llama import LlamaForCausalLM

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
}


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        hidden, patch = v["hidden_size"], v["patch_size"]
        self.class_embedding = nn.Parameter(torch.empty(hidden))
        self.patch_embedding = nn.Conv2d(v.get("num_channels", 3), hidden, patch, stride=patch, bias=False)
        self.position_embedding = nn.Embedding((v["image_size"] // patch) ** 2 + 1, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(pixel_values.shape[0], 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        hidden = v["hidden_size"]
        self.num_heads = v["num_attention_heads"]
        self.head_dim = hidden // self.num_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(hidden, hidden) for _ in range(3))
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (
            p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # every patch sees every patch
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class CLIPMLP(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        self.act = _ACTIVATIONS[v.get("hidden_act", "quick_gelu")]
        self.fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CLIPEncoderLayer(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        eps = v.get("layer_norm_eps", 1e-5)
        self.layer_norm1 = nn.LayerNorm(v["hidden_size"], eps=eps)
        self.self_attn = CLIPAttention(v)
        self.layer_norm2 = nn.LayerNorm(v["hidden_size"], eps=eps)
        self.mlp = CLIPMLP(v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class CLIPEncoder(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(v) for _ in range(v["num_hidden_layers"]))


class CLIPVisionModel(nn.Module):
    """transformers' CLIPVisionModel, run up to the hidden state a feature layer names (0: the embeddings)."""

    def __init__(self, v: dict):
        super().__init__()
        eps = v.get("layer_norm_eps", 1e-5)
        self.embeddings = CLIPVisionEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v["hidden_size"], eps=eps)
        self.encoder = CLIPEncoder(v)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=eps)  # pools the class token: unused by LLaVA

    def forward(self, pixel_values: torch.Tensor, num_layers: int) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.encoder.layers[:num_layers]:
            x = layer(x)
        return x


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class VisionLanguageModel(nn.Module):
    """What the vision-language families share: a language_model that takes the merged embeddings."""

    language_model: nn.Module

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(
        self,
        input_ids,
        positions,
        attn_metadata: list[AttentionMetadata],
        kv_caches,
        intermediate_tensors=None,
        inputs_embeds=None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, attn_metadata, kv_caches, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def use_cpu_ops(self, ops) -> None:
        use_cpu_ops(self.language_model, ops)


def copy_weight(own: dict, name: str, tensor: torch.Tensor) -> None:
    """A vision tower's or projector's checkpoint tensor into its parameter, as it is."""
    if name not in own:
        raise ValueError(f"Checkpoint has an unexpected weight {name!r}")
    if tuple(own[name].shape) != tuple(tensor.shape):
        raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
    with torch.no_grad():
        own[name].copy_(tensor)


class LlavaForConditionalGeneration(VisionLanguageModel):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        d = config.hf_config
        v = d["vision_config"]
        self.config = config
        self.language_model = LlamaForCausalLM(config, backend, quantization)
        self.vision_tower = CLIPVisionModel(v)
        self.multi_modal_projector = LlavaMultiModalProjector(
            v["hidden_size"], config.hidden_size, d.get("multimodal_projector_bias", True)
        )
        # transformers' hidden_states[k] is the state after k layers; a negative k counts from after the last.
        layer = d["vision_feature_layer"]
        self.num_vision_layers = layer if layer >= 0 else v["num_hidden_layers"] + 1 + layer
        self.drop_class_token = d.get("vision_feature_select_strategy", "default") == "default"
        self.attn_backend = backend

    def get_multimodal_embeddings(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings, [its placeholder length, hidden_size]."""
        weight = self.multi_modal_projector.linear_1.weight
        pixel_values = data["pixel_values"].to(weight.device, weight.dtype)
        features = self.vision_tower(pixel_values, self.num_vision_layers)
        if self.drop_class_token:
            features = features[:, 1:]
        return self.multi_modal_projector(features)[0]

    def load_weights(self, weights) -> None:
        """The language model's tensors through its own loader (fusing q/k/v and gate/up); the tower's and the
        projector's as they are. Both checkpoint layouts: transformers 4's (language_model.model.*) and 5's
        (model.language_model.*)."""
        own = dict(self.named_parameters())
        loaded = set()

        def text_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    name = name.replace("vision_tower.vision_model.", "vision_tower.")
                    copy_weight(own, name, tensor)
                    loaded.add(name)
                    continue
                yield name.removeprefix("language_model."), tensor

        self.language_model.load_weights(text_weights())
        missing = [n for n in own if not n.startswith("language_model.") and n not in loaded]
        if missing:
            raise ValueError(f"Checkpoint is missing weights: {sorted(missing)[:8]}")
