"""The vision towers of the vision-language models, in transformers' module names so checkpoints load as they are:
CLIP's (CLIPVisionModel: LLaVA) and SigLIP's (SiglipVisionModel: LLaVA, Gemma 3).

Both are stacks of the same pre-LayerNorm transformer layer (biased q/k/v/out projections, a two-layer MLP); they
differ in their embeddings (CLIP prepends a class token and norms before the first layer; SigLIP's patch embedding
has a bias and no class token) and their default activation. Each image runs whole with bidirectional attention; a
tower is small beside the language model and is not sharded across tensor-parallel ranks.
"""

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

# vision_config.hidden_act values the towers implement (engine/models/config.py refuses the others).
VISION_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
}


class VisionAttention(nn.Module):
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


class VisionMLP(nn.Module):
    def __init__(self, v: dict, default_act: str):
        super().__init__()
        self.act = VISION_ACTIVATIONS[v.get("hidden_act", default_act)]
        self.fc1 = nn.Linear(v["hidden_size"], v["intermediate_size"])
        self.fc2 = nn.Linear(v["intermediate_size"], v["hidden_size"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionEncoderLayer(nn.Module):
    """CLIPEncoderLayer and SiglipEncoderLayer alike."""

    def __init__(self, v: dict, default_act: str, default_eps: float):
        super().__init__()
        eps = v.get("layer_norm_eps", default_eps)
        self.layer_norm1 = nn.LayerNorm(v["hidden_size"], eps=eps)
        self.self_attn = VisionAttention(v)
        self.layer_norm2 = nn.LayerNorm(v["hidden_size"], eps=eps)
        self.mlp = VisionMLP(v, default_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, v: dict, default_act: str, default_eps: float):
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(v, default_act, default_eps) for _ in range(v["num_hidden_layers"])
        )

    def forward(self, x: torch.Tensor, num_layers: int) -> torch.Tensor:
        for layer in self.layers[:num_layers]:
            x = layer(x)
        return x


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


class CLIPVisionModel(nn.Module):
    """transformers' CLIPVisionModel, run up to the hidden state after num_layers layers (0: the embeddings)."""

    def __init__(self, v: dict):
        super().__init__()
        eps = v.get("layer_norm_eps", 1e-5)
        self.embeddings = CLIPVisionEmbeddings(v)
        self.pre_layrnorm = nn.LayerNorm(v["hidden_size"], eps=eps)
        self.encoder = VisionEncoder(v, "quick_gelu", 1e-5)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=eps)  # pools the class token: unused by LLaVA

    def forward(self, pixel_values: torch.Tensor, num_layers: int) -> torch.Tensor:
        return self.encoder(self.pre_layrnorm(self.embeddings(pixel_values)), num_layers)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, v: dict):
        super().__init__()
        hidden, patch = v["hidden_size"], v["patch_size"]
        self.patch_embedding = nn.Conv2d(v.get("num_channels", 3), hidden, patch, stride=patch)
        self.position_embedding = nn.Embedding((v["image_size"] // patch) ** 2, hidden)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    """transformers' SiglipVisionModel without its pooling head (vision_use_head), whose output neither LLaVA nor
    Gemma 3 reads: the hidden state after num_layers layers; post_layernorm makes the last one last_hidden_state."""

    def __init__(self, v: dict):
        super().__init__()
        self.embeddings = SiglipVisionEmbeddings(v)
        self.encoder = VisionEncoder(v, "gelu_pytorch_tanh", 1e-6)
        self.post_layernorm = nn.LayerNorm(v["hidden_size"], eps=v.get("layer_norm_eps", 1e-6))

    def forward(self, pixel_values: torch.Tensor, num_layers: int) -> torch.Tensor:
        return self.encoder(self.embeddings(pixel_values), num_layers)


VISION_TOWERS = {"clip_vision_model": CLIPVisionModel, "siglip_vision_model": SiglipVisionModel}


class VisionLanguageModel(nn.Module):
    """What LLaVA, Gemma 3 and Qwen2-VL share: a language_model that runs the tokens (their image placeholders' embeddings
    merged in by the model runner) and computes the logits, and the checkpoint's layout."""

    language_model: nn.Module

    def get_input_embeddings(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model.embed_tokens(input_ids)

    def forward(self, input_ids, positions, attn_metadata, kv_caches, intermediate_tensors=None, inputs_embeds=None):
        return self.language_model(input_ids, positions, attn_metadata, kv_caches, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden_states)

    def use_cpu_ops(self, ops) -> None:
        self.language_model.use_cpu_ops(ops)

    def load_weights(self, weights) -> None:
        load_vision_language_weights(self, weights)


def copy_weight(own: dict, name: str, tensor: torch.Tensor) -> None:
    """A vision tower's or projector's checkpoint tensor into its parameter, as it is."""
    if name not in own:
        raise ValueError(f"Checkpoint has an unexpected weight {name!r}")
    if tuple(own[name].shape) != tuple(tensor.shape):
        raise ValueError(f"Weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(own[name].shape)}")
    with torch.no_grad():
        own[name].copy_(tensor)


def load_vision_language_weights(model: nn.Module, weights) -> None:
    """A vision-language model's checkpoint: the language model's tensors through its own loader (fusing q/k/v and
    gate/up), the tower's and the projector's as they are. Both checkpoint layouts: transformers 4's
    (language_model.model.*, vision_tower.vision_model.*) and 5's (model.language_model.*, model.vision_tower.*)."""
    own = dict(model.named_parameters())
    loaded = set()

    def text_weights():
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                name = name.replace("vision_tower.vision_model.", "vision_tower.")
                if name.startswith("vision_tower.head."):
                    continue  # SigLIP's pooling head: its output is never read
                copy_weight(own, name, tensor)
                loaded.add(name)
                continue
            yield name.removeprefix("language_model."), tensor

    model.language_model.load_weights(text_weights())
    missing = [n for n in own if not n.startswith("language_model.") and n not in loaded]
    if missing:
        raise ValueError(f"Checkpoint is missing weights: {sorted(missing)[:8]}")
