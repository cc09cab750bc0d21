"""Qwen2-VL and Qwen2.5-VL (Qwen2VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration): a vision
transformer over 3-D patches of any resolution (dynamic resolution: image_grid_thw says an image's grid), whose
patch merger folds each 2 x 2 block of patches into one embedding, and a Qwen2 language model
(engine/models/llama.py) rotated by M-RoPE.

M-RoPE splits the rotary dimensions into three sections turned by a token's temporal, height and width positions:
text tokens have the same position in all three, an image's embeddings their place in its grid
(get_mrope_input_positions, which the model runner reads per request). Qwen2.5-VL's tower uses RMSNorm, a gated
MLP, and attention within windows of patches except in its fullatt_block_indexes layers.
"""

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.models.config import ModelArchConfig
from engine.models.layers import RMSNorm, RotaryEmbedding, rotate_half
from engine.models.llama import LlamaForCausalLM
from engine.models.vision import VisionLanguageModel, copy_weight

_ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


class MRotaryEmbedding(RotaryEmbedding):
    """The text model's rope with mrope_section: positions [3, tokens] pick each section's cos/sin from the table
    at that section's position (a 1-D positions tensor is text only: the plain rope)."""

    def __init__(self, head_dim: int, max_position: int, base: float, mrope_section: list[int]):
        super().__init__(head_dim, max_position, base, None)
        # Each rotary column's section (0: temporal, 1: height, 2: width), the same in both halves.
        half = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(mrope_section)])
        self.section = torch.cat([half, half])

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, dtype)
        index = self.section.to(positions.device).expand(1, positions.shape[1], -1)
        cos, sin = (t.to(positions.device)[positions].gather(0, index)[0].to(dtype) for t in (self.cos, self.sin))
        return cos, sin


def vision_rotary(head_dim: int, theta: float, grid: list[int], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tower's 2-D rope for one image: each patch's (height, width) position, the patches ordered as the
    processor flattens them (merge x merge blocks, row by row), over a quarter of head_dim each."""
    t, h, w = grid
    spatial = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
    hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    blocks = (h // merge, merge, w // merge, merge)
    hpos, wpos = (p.reshape(blocks).transpose(1, 2).flatten() for p in (hpos, wpos))
    positions = torch.stack([hpos, wpos], dim=-1).repeat(t, 1)
    freqs = positions[..., None].float() * inv_freq
    freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        # Rotated in float32, as transformers does.
        cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        out = []
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):  # every patch sees every patch of its window
            q_, k_, v_ = (t[start:end].transpose(0, 1) for t in (q, k, v))
            out.append(F.scaled_dot_product_attention(q_, k_, v_, scale=self.head_dim**-0.5).transpose(0, 1))
        return self.proj(torch.cat(out).reshape(n, -1))


class VisionMlp(nn.Module):
    """Qwen2-VL's: fc1, activation, fc2."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL's: a gated MLP with biases."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm):
        super().__init__()
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each merge x merge block of patches (consecutive rows here) concatenated, through a two-layer GELU MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int, norm):
        super().__init__()
        self.hidden = dim * merge**2
        self.ln_q = norm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """transformers' Qwen2VisionTransformerPretrainedModel (qwen2_5: Qwen2_5_VisionTransformerPretrainedModel),
    one image at a time."""

    def __init__(self, v: dict, qwen2_5: bool):
        super().__init__()
        self.merge = v["spatial_merge_size"]
        self.patch, self.temporal_patch = v["patch_size"], v["temporal_patch_size"]
        self.in_channels = v["in_channels"]
        if qwen2_5:
            dim, out_dim = v["hidden_size"], v["out_hidden_size"]

            def norm(d):
                return RMSNorm(d, 1e-6)

            def mlp():
                return VisionGatedMlp(dim, v["intermediate_size"], v["hidden_act"])

            # Windows of window_size pixels; these layers attend over the whole image.
            self.window = v["window_size"] // self.merge // self.patch
            self.full_layers = set(v["fullatt_block_indexes"])
        else:
            dim, out_dim = v["embed_dim"], v["hidden_size"]

            def norm(d):
                return nn.LayerNorm(d, eps=1e-6)

            def mlp():
                return VisionMlp(dim, int(dim * v["mlp_ratio"]), v["hidden_act"])

            self.window = None
            self.full_layers = set(range(v["depth"]))
        self.dim, self.head_dim = dim, dim // v["num_heads"]
        self.theta = float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        kernel = (self.temporal_patch, self.patch, self.patch)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(self.in_channels, dim, kernel, stride=kernel, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(dim, v["num_heads"], mlp(), norm) for _ in range(v["depth"]))
        self.merger = PatchMerger(out_dim, dim, self.merge, norm)

    def window_index(self, grid: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the merged patches reordered window by window (windows of self.window merged patches a
        side, row by row), and the windows' bounds in patches."""
        t, h, w = grid[0], grid[1] // self.merge, grid[2] // self.merge
        index = torch.arange(t * h * w).reshape(t, h, w)
        size = self.window
        pad_h, pad_w = size - h % size, size - w % size
        nh, nw = (h + pad_h) // size, (w + pad_w) // size
        padded = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        padded = padded.reshape(t, nh, size, nw, size).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, size, size)
        lengths = (padded != -100).sum([2, 3]).reshape(-1)
        padded = padded.reshape(-1)
        bounds = [0] + [int(x) * self.merge**2 for x in lengths.cumsum(0)]
        return padded[padded != -100], sorted(set(bounds))

    def forward(self, pixel_values: torch.Tensor, grid: list[int]) -> torch.Tensor:
        weight = self.patch_embed.proj.weight
        x = pixel_values.to(weight.device, weight.dtype)
        x = x.view(-1, self.in_channels, self.temporal_patch, self.patch, self.patch)
        x = self.patch_embed.proj(x).view(-1, self.dim)
        cos, sin = (e.to(x.device) for e in vision_rotary(self.head_dim, self.theta, grid, self.merge))
        n = x.shape[0]
        frames = [i * grid[1] * grid[2] for i in range(grid[0] + 1)]  # full attention is per frame
        order, windows = None, frames
        if self.window is not None:
            order, windows = self.window_index(grid)
            unit = self.merge**2

            def permute(tensor):
                return tensor.reshape(n // unit, unit, -1)[order.to(tensor.device)].reshape(n, -1)

            x, cos, sin = permute(x), permute(cos), permute(sin)
        for i, block in enumerate(self.blocks):
            x = block(x, frames if i in self.full_layers else windows, cos, sin)
        x = self.merger(x)
        return x if order is None else x[torch.argsort(order).to(x.device)]


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """Qwen2-VL (and Qwen2.5-VL, the same seams): the tower's embeddings (get_multimodal_embeddings), merged by the
    model runner at each image's placeholders, into the Qwen2 language model under M-RoPE."""

    uses_mrope = True

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, quantization: str | None = None):
        super().__init__()
        d = config.hf_config
        self.config = config
        self.language_model = LlamaForCausalLM(config, backend, quantization)
        self.language_model.rotary = MRotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, d["mrope_section"]
        )
        self.visual = Qwen2VisionTransformer(d["vision_config"], d["qwen2_5"])
        self.merge = d["vision_config"]["spatial_merge_size"]
        self.attn_backend = backend

    def get_multimodal_embeddings(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """One image's embeddings, [t * h * w / merge^2, hidden_size]."""
        return self.visual(data["pixel_values"], [int(x) for x in data["image_grid_thw"][0]])

    def get_mrope_input_positions(self, prompt_token_ids: list[int], mm_features: list) -> tuple[torch.Tensor, int]:
        """The prompt's M-RoPE positions [3, prompt length] and the delta a later token's position (the same in all
        three) adds to its index: text counts on from the last position; an image's embeddings sit at their grid's
        (temporal, row, column) from where the image starts, and the text after it starts past its larger side."""
        pieces, at, pos = [], 0, 0
        for feature in sorted(mm_features, key=lambda f: f.mm_position.offset):
            text = feature.mm_position.offset - at
            pieces.append(torch.arange(text).expand(3, -1) + pos)
            pos += text
            t, h, w = (int(x) for x in feature.data["image_grid_thw"][0])
            h, w = h // self.merge, w // self.merge
            grid = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            pieces.append(torch.stack(grid).reshape(3, -1) + pos)
            pos += max(h, w)
            at = feature.mm_position.end
        pieces.append(torch.arange(len(prompt_token_ids) - at).expand(3, -1) + pos)
        positions = torch.cat(pieces, dim=1)
        return positions, int(positions.max()) + 1 - len(prompt_token_ids) if positions.numel() else 0

    def load_weights(self, weights) -> None:
        """The language model's tensors through its own loader; the tower's as they are. Both checkpoint layouts:
        transformers 4's (visual.*, model.*) and 5's (model.visual.*, model.language_model.*)."""
        own = dict(self.named_parameters())
        loaded = set()

        def text_weights():
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith("visual."):
                    copy_weight(own, name, tensor)
                    loaded.add(name)
                    continue
                yield name.removeprefix("language_model."), tensor

        self.language_model.load_weights(text_weights())
        missing = [n for n in own if n.startswith("visual.") and n not in loaded]
        if missing:
            raise ValueError(f"Checkpoint is missing weights: {sorted(missing)[:8]}")
